"""The venv `make` installs: what a job imports from it is byte-compiled (issue 29).

uv writes no .pyc unless asked, and where PYTHONDONTWRITEBYTECODE is set (CI, this project's hosts) Python never
caches one at import either: every process of every job and test then compiled torch, transformers and the rest
from source again (a fresh-clone `make test` took 60 min instead of 32, a job's imports 2-4x the CPU).
"""

import importlib
import importlib.util
import os
import sys
import sysconfig

# What the processes of a job's trainer, replay buffer and generators (HF or vLLM engine) import.
JOB_MODULES = ["actors.trainer", "actors.replay_buffer", "actors.generator", "actors.engines.vllm"]


def _uncompiled_venv_modules() -> list[str]:
    """Modules loaded in this process from the venv's site-packages whose source has no .pyc next to it."""
    site_packages = os.path.realpath(sysconfig.get_paths()["purelib"]) + os.sep
    uncompiled = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py") and os.path.realpath(path).startswith(site_packages):
            if not os.path.exists(importlib.util.cache_from_source(path)):
                uncompiled.append(name)
    return sorted(uncompiled)


def test_what_a_job_imports_from_the_venv_is_byte_compiled():
    for name in JOB_MODULES:
        importlib.import_module(name)
    uncompiled = _uncompiled_venv_modules()
    assert not uncompiled, (
        f"{len(uncompiled)} modules a job imports from {sysconfig.get_paths()['purelib']} have no .pyc, so each "
        f"process compiles them again (e.g. {', '.join(uncompiled[:8])}): install with `uv pip install "
        "--compile-bytecode` (the Makefile does), or run `python -m compileall -q -j0` on that folder")
