"""`python -m apps.eval`: the command line is read and checked before torch or Monarch is imported.

`--help` prints every key (rendered from the config dataclasses' field docstrings, as `apps.grpo --help` does);
YAML, override and schema errors exit with code 2 before anything starts.
"""

from __future__ import annotations

import sys

from apps.app_config import load_app_config
from apps.eval.config import EvalJobConfig
from forge.config import ConfigError, parse_args, to_yaml
from rl.tasks.config import TaskConfig

DESCRIPTION = ("Evaluate a model, a checkpoint, every checkpoint of a run, or an OpenAI-compatible endpoint on tasks' "
               "held-out sets: accuracy / mean reward, pass@k and mean@k (docs/eval.md).")


def reference() -> str:
    """Every key with its type, default and meaning."""
    from apps.config_reference import sections  # the same renderer as apps.grpo's reference (no torch)

    lines = sections(EvalJobConfig, "", "")
    lines += sections(TaskConfig, "tasks[i].", "Each entry of `tasks`.")
    return "Configuration keys:\n\n" + "\n".join(lines)


def load_eval_config(argv: list[str]) -> EvalJobConfig:
    """Parse, resolve `model: tiny` to the built checkpoint, validate and run the check step (`EvalJobConfig.check`:
    the model and folders named): every config error before any process."""
    path, overrides, args = parse_args(argv, description=DESCRIPTION, epilog=reference())
    if args.resume:
        raise ConfigError("--resume: an evaluation has nothing to resume; run it again")
    return load_app_config(path, overrides, EvalJobConfig, check=EvalJobConfig.check)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_eval_config(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    from apps.eval.main import run  # torch; Monarch only when a generator service is started

    return run(cfg)
