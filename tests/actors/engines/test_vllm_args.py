"""engine_arg_names: the AsyncEngineArgs field names, read without importing vLLM."""

import dataclasses
import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")


def test_engine_arg_names_equal_the_dataclass_fields():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from actors.engines.vllm import engine_arg_names

    assert engine_arg_names() == {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    assert {"max_model_len", "enforce_eager", "enable_log_requests"} <= engine_arg_names()


def test_engine_arg_names_does_not_import_vllm():
    code = ("import sys; from actors.engines.vllm import engine_arg_names; "
            "assert len(engine_arg_names()) > 100; assert 'vllm' not in sys.modules, 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
