"""Verifiable tasks: prompts with answers that a reward function checks exactly."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from forge.tasks.arithmetic import ArithmeticTask, Problem

__all__ = ["ArithmeticTask", "Problem", "load_callable"]


def load_callable(reference: str, *, field: str) -> Callable[..., Any]:
    """'package.module:function' -> the function; errors name the config field and the value."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{field}={reference!r}: must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field}={reference!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field}={reference!r}: module {module_name!r} has no callable {attr!r}")
    return fn
