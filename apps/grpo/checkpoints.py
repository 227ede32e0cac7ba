"""Deprecated: job checkpoints moved to apps.run_checkpoints (shared by apps.grpo and apps.sft). The old names import
from here, with a DeprecationWarning, for one release."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from apps import run_checkpoints

    if name not in ("JobCheckpoints", "CheckpointConfig"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use apps.run_checkpoints.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(run_checkpoints, name)
