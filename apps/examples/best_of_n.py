"""Best-of-n sampling with a custom reward actor, composed from forge's building blocks.

    python -m apps.examples.best_of_n --config configs/example_best_of_n.yaml sampling.n=16

For each held-out arithmetic problem, a Generator service (`replicas` processes) samples `sampling.n`
completions, the user's own `Scorer` actor (apps/examples/scorer.py) scores them, and the best one is
kept. All prompts are in flight at once; the service spreads them over its replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from actors.generator import Generator, GeneratorConfig
from apps.examples.scorer import Scorer, ScorerConfig
from forge.config import ConfigError, load_config, parse_args, validate
from forge.lifecycle import run_job
from forge.metrics import MetricLogger, MetricsConfig
from forge.provisioner import get_provisioner
from rl.tasks.arithmetic import ArithmeticTask, Problem
from rl.tiny_model import ensure_tiny_checkpoint
from rl.types import SamplingParams
from forge.weights.startup import start_weight_store


@dataclass
class TaskConfig:
    num_prompts: int = 4  # problems taken from the task's held-out set
    num_digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits={self.num_digits}: must be >= 1")
        most = 10 ** (2 * self.num_digits) // 2  # the task holds out at most half of its problems
        if not 1 <= self.num_prompts <= most:
            raise ValueError(f"num_prompts={self.num_prompts}: must be in [1, {most}] for num_digits={self.num_digits}")


@dataclass
class BestOfNConfig:
    generator: GeneratorConfig
    build_tiny_model: bool = True  # build forge's tiny checkpoint at generator.model if it is not there
    replicas: int = 2
    sampling: SamplingParams = field(default_factory=SamplingParams)
    task: TaskConfig = field(default_factory=TaskConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas}: must be >= 1")


@dataclass
class Best:
    problem: Problem
    text: str
    reward: float
    mean_reward: float


async def best_of_n(cfg: BestOfNConfig) -> list[Best]:
    """Spawn the generator service and the scorer, then pick the best of n completions per problem."""
    await start_weight_store()  # generators follow published weights from there
    generators = await Generator.options(num_replicas=cfg.replicas, mesh_name="generator").as_service(cfg.generator)
    scorer = await Scorer.options(mesh_name="scorer").as_actor(cfg.scorer)
    print(f"generator replicas: {cfg.replicas}, policy versions {await generators.policy_version.fanout()}")

    async def pick(problem: Problem) -> Best:
        completions = await generators.generate.route(problem.prompt, cfg.sampling)
        rewards = await scorer.score.call_one(problem.answer, [c.text for c in completions])
        best = max(range(len(rewards)), key=rewards.__getitem__)
        return Best(problem, completions[best].text, rewards[best], sum(rewards) / len(rewards))

    task = ArithmeticTask(cfg.task.seed, cfg.task.num_digits, held_out=cfg.task.num_prompts)
    return list(await asyncio.gather(*(pick(p) for p in task.held_out())))


async def report(cfg: BestOfNConfig) -> None:
    """Print each problem's best completion and the metrics the actors recorded (reduced by the controller)."""
    results = await best_of_n(cfg)
    for b in results:
        print(f"{b.problem.prompt} (answer {b.problem.answer}): best {b.text!r} reward {b.reward:.3f} | "
              f"mean {b.mean_reward:.3f} over {cfg.sampling.n}")
    mean_best = sum(b.reward for b in results) / len(results)
    mean = sum(b.mean_reward for b in results) / len(results)
    print(f"best-of-{cfg.sampling.n} over {len(results)} prompts: mean best reward {mean_best:.3f}, "
          f"mean reward {mean:.3f}")
    MetricLogger.from_config(cfg.metrics).log(0, await get_provisioner().collect_metrics())


def main(argv: list[str] | None = None) -> int:
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0])
    try:
        cfg = validate(load_config(path, overrides), BestOfNConfig)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)  # before any process is spawned
        return 2
    model = str(Path(cfg.generator.model).expanduser())
    if cfg.build_tiny_model:
        ensure_tiny_checkpoint(model)
    cfg = dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, model=model))
    # forge.lifecycle: a dead actor process or an error ends the job with the cause, Ctrl-C stops it, and every
    # process it started is stopped whatever happened. The exit code says which (0, 1, 128 + signal).
    return run_job(lambda: report(cfg))


if __name__ == "__main__":
    sys.exit(main())
