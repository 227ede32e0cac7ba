"""`python -m apps.sft`: the command line is read and checked before the training stack is imported.

`--help` prints every key (rendered from the config dataclasses' field docstrings, as `apps.grpo --help` does);
YAML, override and schema errors exit with code 2 before anything starts.
"""

from __future__ import annotations

import sys

from apps.app_config import load_app_config
from apps.sft.config import SFTConfig
from forge.config import ConfigError, parse_args, to_yaml

DESCRIPTION = ("Supervised fine-tuning on a task's reference answers, prompt-completion rows or chat conversations, "
               "through apps.grpo's TorchTitan trainer (docs/sft.md).")


def reference() -> str:
    """Every key with its type, default and meaning."""
    from apps.config_reference import sections  # the same renderer as apps.grpo's reference (no torch)

    return "Configuration keys:\n\n" + "\n".join(sections(SFTConfig, "", ""))


def load_sft_config(argv: list[str]) -> tuple[SFTConfig, bool]:
    """Parse, resolve `model: tiny` to the built checkpoint, validate and run the check step (`SFTConfig.check`: the
    files the config names): every config error before any process."""
    path, overrides, args = parse_args(argv, description=DESCRIPTION, epilog=reference())
    cfg = load_app_config(path, overrides, SFTConfig, check=SFTConfig.check)  # `model: tiny`: tiny_shape's
    return cfg, bool(args.resume or cfg.resume)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = load_sft_config(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    from apps.sft.sources import load_job_data  # torch and transformers: a bad row is refused before Monarch loads

    try:
        tokenizer, data = load_job_data(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from apps.sft.main import run  # Monarch, TorchTitan

    return run(cfg, tokenizer, data, resume)
