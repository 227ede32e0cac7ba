"""Deprecated: moved to apps.held_out.scores (the held-out evaluator the apps share). The old names import from here,
with a DeprecationWarning, for one release."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from apps.held_out import scores

    if name.startswith("__") or not hasattr(scores, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use apps.held_out.scores.{name}", DeprecationWarning, stacklevel=2)
    return getattr(scores, name)
