"""engine_arg_names: the AsyncEngineArgs field names, read without importing vLLM."""

import dataclasses
import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")


def test_engine_arg_names_equal_the_dataclass_fields():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from actors.engines.vllm_args import engine_arg_names

    assert engine_arg_names() == {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    assert {"max_model_len", "enforce_eager", "enable_log_requests"} <= engine_arg_names()


def test_engine_arg_names_imports_neither_vllm_nor_torch():
    code = ("import sys; from actors.engines.vllm_args import engine_arg_names; "
            "assert len(engine_arg_names()) > 100; "
            "assert not {'vllm', 'torch'} & set(sys.modules), sorted({'vllm', 'torch'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("engine_args, message", [
    ({"max_model_length": 256}, r"unknown vLLM engine argument\(s\) \['max_model_length'\]"),
    ({"tokenizer": "other"}, r"\['tokenizer'\] are set by the generator"),
    ({"logprobs_mode": "raw_logprobs"}, r"\['logprobs_mode'\] are set by the generator .* or by the engine"),
    ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2: the vllm engine runs tensor-parallel "
                                  r"on CUDA only"),
    ({"block_size": 16}, r"engine_args.block_size=16: vLLM's CPU attention needs a positive multiple of 32"),
], ids=["unknown", "set-by-generator", "set-by-engine", "tp-on-cpu", "cpu-block-size"])
def test_bad_engine_args_are_refused_before_vllm_starts(tmp_path, engine_args, message):
    from actors.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=message):
        VLLMEngine(tmp_path, dtype="float32", device="cpu", **engine_args)


def test_a_device_this_vllm_build_cannot_run_on_is_refused(tmp_path):
    from vllm.platforms import current_platform

    from actors.engines.vllm import VLLMEngine

    other = "cuda" if current_platform.device_type == "cpu" else "cpu"
    with pytest.raises(ValueError, match=rf"device='{other}': this vLLM build runs on '{current_platform.device_type}'"):
        VLLMEngine(tmp_path, dtype="float32", device=other)
