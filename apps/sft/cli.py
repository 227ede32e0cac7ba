"""`python -m apps.sft`: the command line is read and checked before the training stack is imported.

`--help` prints every key (rendered from the config dataclasses' field docstrings, as `apps.grpo --help` does);
YAML, override and schema errors exit with code 2 before anything starts.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from apps.app_config import load_app_config
from apps.sft.config import SFTConfig
from forge.config import ConfigError, load_config, parse_args, to_yaml, validate
from rl.tiny_model import TINY_MODEL, check_shape, checkpoint_dir, ensure_tiny_checkpoint, is_built, write_tiny_config

DESCRIPTION = ("Supervised fine-tuning on a task's reference answers, prompt-completion rows or chat conversations, "
               "through apps.grpo's TorchTitan trainer (docs/sft.md).")


def reference() -> str:
    """Every key with its type, default and meaning."""
    from apps.config_reference import sections  # the same renderer as apps.grpo's reference (no torch)

    return "Configuration keys:\n\n" + "\n".join(sections(SFTConfig, "", ""))


def load_sft_config(argv: list[str]) -> tuple[SFTConfig, bool]:
    """Parse, resolve `model: tiny` to the built checkpoint, validate: every config error before any process."""
    path, overrides, args = parse_args(argv, description=DESCRIPTION, epilog=reference())
    cfg = load_app_config(path, [*overrides, *shaped_tiny_model(path, overrides)], SFTConfig)
    return cfg, bool(args.resume or cfg.resume)


def shaped_tiny_model(path: str | None, overrides: Sequence[str]) -> list[str]:
    """`model: tiny` with a `tiny_shape`: the override pointing `model` at that shape's checkpoint, built once into
    `model_cache` after the whole job was checked against its config.json alone (a config error costs no torch
    import). No shape: no override (`model: tiny` is the default shape, resolved by load_app_config)."""
    raw = load_config(path, overrides)
    shape = raw.get("tiny_shape")
    if not isinstance(shape, DictConfig) or not shape:
        return []  # none, or not a mapping: the schema refuses it, naming the key
    shape = OmegaConf.to_container(shape)
    if raw.get("model", TINY_MODEL) != TINY_MODEL:
        raise ConfigError(f"tiny_shape={shape}: shapes the tiny model only (model: tiny), not model="
                          f"{raw.get('model')!r}; remove tiny_shape or set model=tiny")
    try:
        check_shape(shape, "tiny_shape")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    folder = Path(raw.get("model_cache", ".cache/forge")) / checkpoint_dir(shape)
    if not is_built(folder):
        with tempfile.TemporaryDirectory() as config_only:
            validate(load_config(path, [*overrides, f"model={write_tiny_config(config_only, **shape)}"]), SFTConfig)
        ensure_tiny_checkpoint(folder, **shape)
    return [f"model={folder}"]


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = load_sft_config(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    from apps.sft.main import run  # torch, Monarch, TorchTitan

    return run(cfg, resume)
