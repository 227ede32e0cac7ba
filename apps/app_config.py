"""Loading an app's config: forge.config's loader and checks, with `model: tiny` resolved to the tiny checkpoint
the CPU configs train (rl/tiny_model.py), built on first use."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from forge.config import load_config, validate
from rl.tiny_model import TINY_CHECKPOINT_DIR, TINY_MODEL, ensure_tiny_checkpoint, is_built, write_tiny_config

T = TypeVar("T")


def load_app_config(path: str | Path | None, overrides: Sequence[str], schema: type[T]) -> T:
    """Load and validate an app's config, `model: tiny` resolved to forge's tiny checkpoint in `model_cache`
    (its path fills `${model}`). A first run checks the job against the tiny model's config.json before
    building the checkpoint, so a config error costs no torch import even then."""
    cfg = load_config(path, overrides)
    if cfg.get("model", TINY_MODEL) != TINY_MODEL:
        return validate(cfg, schema)
    tiny = Path(cfg.get("model_cache", ".cache/forge")) / TINY_CHECKPOINT_DIR
    if not is_built(tiny):
        with tempfile.TemporaryDirectory() as config_only:
            validate(load_config(path, [*overrides, f"model={write_tiny_config(config_only)}"]), schema)
        ensure_tiny_checkpoint(tiny)
    return validate(load_config(path, [*overrides, f"model={tiny}"]), schema)
