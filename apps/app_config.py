"""Loading an app's config: forge.config's loader and checks, with `model: tiny` resolved to the tiny checkpoint
the CPU configs train (rl/tiny_model.py, of the config's `tiny_shape` where its schema has one), built on first use."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from forge.config import ConfigError, load_config, validate
from rl.tiny_model import TINY_MODEL, check_shape, checkpoint_dir, ensure_tiny_checkpoint, is_built, write_tiny_config

T = TypeVar("T")


def load_app_config(path: str | Path | None, overrides: Sequence[str], schema: type[T],
                    check: Callable[[T], None] | None = None) -> T:
    """Load and validate an app's config, `model: tiny` resolved to forge's tiny checkpoint in `model_cache`
    (its path fills `${model}`), then run `check` on it: the app's check step, the checks that read the model's files
    or the hub (building the config reads none). A first run checks the job against the tiny model's config.json
    before building the checkpoint, so a config error costs no torch import even then."""

    def checked(cfg: Any) -> T:
        job = validate(cfg, schema)
        if check is not None:
            try:
                check(job)
            except ValueError as e:  # as validate reports the schema's own errors
                raise ConfigError(str(e)) from None
        return job

    cfg = load_config(path, overrides)
    shape = tiny_shape(cfg)
    if cfg.get("model", TINY_MODEL) != TINY_MODEL:
        if shape:
            raise ConfigError(f"tiny_shape={shape}: shapes the tiny model only (model: tiny), not model="
                              f"{cfg.get('model')!r}; remove tiny_shape or set model=tiny")
        return checked(cfg)
    tiny = Path(cfg.get("model_cache", ".cache/forge")) / checkpoint_dir(shape)
    if not is_built(tiny):
        with tempfile.TemporaryDirectory() as config_only:
            checked(load_config(path, [*overrides, f"model={write_tiny_config(config_only, **shape)}"]))
        ensure_tiny_checkpoint(tiny, **shape)
    return checked(load_config(path, [*overrides, f"model={tiny}"]))


def tiny_shape(cfg: DictConfig) -> dict[str, Any]:
    """The config's `tiny_shape` (the tiny model's shape fields to change), checked; {} when it has none. One that
    is not a mapping is left to the schema, which refuses it naming the key (and a schema without the key refuses
    it before anything is built)."""
    shape = cfg.get("tiny_shape")
    if not isinstance(shape, DictConfig) or not shape:
        return {}
    shape = OmegaConf.to_container(shape)
    try:
        check_shape(shape, "tiny_shape")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return shape
