"""`python -m apps.grpo`: the command line is read and checked before the training stack is imported.

`--help`, YAML and override errors, the schema's checks (apps/grpo/config.py and the actors' config modules it names)
and its check step (`GRPOConfig.check`: the model's layout against its config.json, the teacher's tokenizer) import no
torch, Monarch, TorchTitan or vLLM; the stack comes with apps.grpo.main once the config is known to be good. Config
errors exit with code 2.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from apps.app_config import load_app_config
from forge.config import ConfigError, parse_args, to_yaml

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

DESCRIPTION = "Asynchronous GRPO: rollout loops and the training loop run concurrently, decoupled by the replay buffer."


def load_job_config(argv: list[str]) -> tuple[GRPOConfig, bool]:
    """Parse, resolve `model: tiny` to the built checkpoint, validate and run the check step: every config error
    before any process.
    `--help` prints the configuration reference (docs/configuration.md)."""
    from apps.grpo.config import GRPOConfig  # the schema (no torch: see the module's docstring)
    from apps.grpo.config_reference import reference

    path, overrides, args = parse_args(argv, description=DESCRIPTION, epilog=reference())

    job = load_app_config(path, overrides, GRPOConfig, check=GRPOConfig.check)
    return job, bool(args.resume or job.resume)


def check_resources(cfg: GRPOConfig) -> None:
    """With `resources.with_gpus`, the layout must fit the visible GPUs."""
    if not cfg.resources.with_gpus:
        return
    import torch

    r, tp, scorer = cfg.resources, cfg.generator_gpus_per_proc, cfg.scorer_gpus
    wanted = r.generator_replicas * r.generator_procs * tp + r.trainer_procs + scorer
    scorer_label = f"the {cfg.teacher.engine} teacher's {scorer}" if cfg.teacher.on_engine else f"reference_procs={scorer}"
    have = torch.cuda.device_count()
    if wanted > have:
        raise ConfigError(
            f"resources: the layout needs {wanted} GPUs (generator_replicas={r.generator_replicas} x generator_procs="
            f"{r.generator_procs}{f' x tensor_parallel_size={tp}' if tp > 1 else ''} + trainer_procs={r.trainer_procs}"
            f"{f' + {scorer_label}' if scorer else ''}) but {have} are visible"
        )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = load_job_config(sys.argv[1:] if argv is None else argv)
        check_resources(cfg)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    from apps.grpo.main import run  # torch, Monarch, TorchTitan
    from forge.provisioner import configure_hosts

    try:
        configure_hosts(cfg.hosts)  # before anything starts Monarch: reachable agents, the tcp transport
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return run(cfg, resume)
