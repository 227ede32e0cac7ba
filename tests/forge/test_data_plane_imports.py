"""The data plane runs on any torch: the engines, the shared-memory write and read path of the weight store, the
log-prob math and the state-dict conversion import no Monarch or torchstore (and the parts a GPU machine with
a bare torch image runs, no torchtitan or vLLM either). Each check imports the modules in a fresh interpreter
whose import system refuses the blocked packages."""

from __future__ import annotations

from tests.blocked_imports import import_with_blocked


def test_the_data_plane_imports_without_monarch_or_torchstore():
    modules = ["forge.shm_weights", "actors.engines.weights", "actors.engines.hf", "actors.engines.vllm",
               "actors.logprobs", "actors.model_builder"]
    result = import_with_blocked(modules, ["monarch", "torchstore"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_what_a_bare_torch_gpu_image_runs_imports_without_torchtitan_or_vllm():
    modules = ["forge.shm_weights", "actors.engines.weights", "actors.engines.hf", "actors.engines.vllm",
               "actors.logprobs", "bench.publish_to_ready"]
    result = import_with_blocked(modules, ["monarch", "torchstore", "torchtitan", "vllm"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_a_module_that_imports_a_blocked_package_is_reported_with_its_import():
    result = import_with_blocked(["forge.weight_store"], ["monarch", "torchstore"])
    assert result.returncode == 1
    assert "forge.weight_store:" in result.stdout and "is blocked in this test" in result.stdout
    assert "forge/compat.py" in result.stdout or "forge/weights/store.py" in result.stdout, result.stdout
