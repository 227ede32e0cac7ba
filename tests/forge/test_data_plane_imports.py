"""The data plane runs on any torch: the engines, the shared-memory write and read path of the weight store, the
log-prob math and the state-dict conversion import no Monarch or torchstore (and the parts a GPU machine with
a bare torch image runs, no torchtitan or vLLM either). Each check imports the modules in a fresh interpreter
whose import system refuses the blocked packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in the child: refuse the blocked top-level packages, prove the refusal works, import every module and
# report, for each that fails, the import that pulled a blocked package in.
_CHILD = """
import importlib, sys, traceback
blocked, modules = sys.argv[1].split(","), sys.argv[2].split(",")

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Refuse())
for package in blocked:
    try:
        importlib.import_module(package)
    except ImportError:
        continue
    sys.exit(f"the blocker let {package} through")
failures = []
for module in modules:
    try:
        importlib.import_module(module)
    except ImportError as e:
        ours = [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_tb(e.__traceback__)
                if f.filename.startswith(sys.argv[3])]
        failures.append(f"{module}: {e} (via {ours[-1] if ours else '?'})")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, ",".join(blocked), ",".join(modules), str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


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
    assert "forge/compat.py" in result.stdout or "forge/weight_store.py" in result.stdout, result.stdout
