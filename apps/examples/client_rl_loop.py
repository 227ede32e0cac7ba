"""GRPO written only against forge's REST client: sample, score, forward_backward, optim_step, sync weights.

    python -m apps.server --config configs/server_tiny.yaml &            # the training service
    python -m apps.examples.client_rl_loop --base-url http://127.0.0.1:8000 --steps 20

The server holds the model, the optimizer and the generators; this process only makes HTTP calls (through
`apps.server.client`) and scores answers to 2-digit additions. It prints held-out greedy accuracy before and after,
scored by forge's held-out evaluator (apps/held_out/: plain Python, no torch) over the server's sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

from apps.held_out.evaluate import Reward, evaluate_greedy
from apps.held_out.samplers import BatchingSampler
from apps.server.client import AdamParams, Datum, SamplingClient, SamplingParams, ServiceClient
from rl.tasks.arithmetic import ArithmeticTask, Problem


@dataclass
class LoopConfig:
    base_url: str | None = None  # None: $FORGE_BASE_URL, else http://127.0.0.1:8000
    api_key: str | None = None  # None: $FORGE_API_KEY
    steps: int = 20
    prompts_per_step: int = 64
    group_size: int = 16
    minibatches: int = 4  # optimizer steps per sampled batch (one slice of whole groups each)
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # clipped as apps.grpo clips: without it the loop learns far less (docs/benchmarks.md)
    clip_eps: float = 0.2
    max_tokens: int = 4
    temperature: float = 1.0
    eval_prompts: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "minibatches", "max_tokens", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"--group-size={self.group_size}: must be >= 2 (advantages are relative to the group)")
        if self.prompts_per_step % self.minibatches:
            raise ValueError(f"--prompts-per-step={self.prompts_per_step}: must be a multiple of "
                             f"--minibatches={self.minibatches}")
        if self.learning_rate <= 0 or self.temperature <= 0:
            raise ValueError("--learning-rate and --temperature must be > 0")


class ServerSampler:
    """The held-out evaluator's sampler (apps/held_out/) over the server's sampling: a batch of problems in one
    request."""

    def __init__(self, sampler: SamplingClient) -> None:
        self.sampler = sampler

    async def sample_many(self, problems: list[Problem], params: SamplingParams) -> list[list[str]]:
        out = await self.sampler.sample_many([p.prompt for p in problems], params)
        return [[s.text for s in samples] for samples in out.samples]


def accuracy(sampler: SamplingClient, task: ArithmeticTask, problems: list[Problem], max_tokens: int,
             log=print) -> float:
    """Greedy held-out accuracy with the server's current (synced) weights, by the evaluator forge's apps report with
    (one request): a sample whose request or reward failed is left out, and said."""
    score = asyncio.run(evaluate_greedy(BatchingSampler(ServerSampler(sampler)), problems, Reward(task.reward, None),
                                        max_tokens=max_tokens, label="held-out"))
    if score.failed_samples:
        log(f"held-out: {score.failed_samples} of {score.samples} samples failed, left out: {score.failures}")
    return score.mean_reward


def group_datums(prompt_tokens: list[int], samples: list, rewards: list[float]) -> list[Datum]:
    """GRPO data for one prompt's group: advantage (r - mean) / std on the completion's tokens. `from_sample` keeps
    what the trainer must score the sample with (its temperature, and top_k/top_p's kept sets)."""
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [Datum.from_sample(prompt_tokens, sample, (reward - mean) / (std + 1e-6) if std > 0 else 0.0, reward=reward)
            for sample, reward in zip(samples, rewards)]


def run(cfg: LoopConfig, log=print) -> dict:
    task = ArithmeticTask(seed=cfg.seed, num_digits=2, held_out=500)
    held_out = task.held_out()[: cfg.eval_prompts]
    rng = random.Random(f"{cfg.seed}-client-loop")
    with ServiceClient(cfg.base_url, cfg.api_key) as service:
        training = service.create_training_client(metadata={"app": "client_rl_loop"})
        sampler = service.create_sampling_client()
        try:
            training.sync_inference_weights().result()  # the generators serve this session's starting weights
            start_accuracy = accuracy(sampler, task, held_out, cfg.max_tokens, log)
            log(f"session {training.session_id}: held-out greedy accuracy before: {start_accuracy:.1%}")
            params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
            adam = AdamParams(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                              grad_clip_norm=cfg.grad_clip_norm)
            started, rewards_per_step = time.perf_counter(), []
            for step in range(1, cfg.steps + 1):
                problems = task.sample_prompts(cfg.prompts_per_step, rng)
                out = sampler.sample_many([p.prompt for p in problems], params, num_samples=cfg.group_size).result()
                groups, step_rewards = [], []
                for problem, prompt_tokens, samples in zip(problems, out.prompt_tokens, out.samples):
                    rewards = [task.reward(s.text, problem.answer) for s in samples]
                    step_rewards += rewards
                    groups.append(group_datums(prompt_tokens, samples, rewards))
                # Submit every minibatch's forward_backward + optim_step, then the sync, without waiting:
                # the server runs them in call order.
                per = cfg.prompts_per_step // cfg.minibatches
                futures = []
                for m in range(cfg.minibatches):
                    data = [d for group in groups[m * per : (m + 1) * per] for d in group]
                    futures.append(training.forward_backward(data, "grpo", {"clip_eps": cfg.clip_eps}))
                    futures.append(training.optim_step(adam))
                sync = training.sync_inference_weights()
                losses = [f.result().loss for f in futures[::2]]
                version = sync.result().policy_version
                rewards_per_step.append(statistics.fmean(step_rewards))
                log(f"step {step}/{cfg.steps}: reward {rewards_per_step[-1]:.3f} loss {statistics.fmean(losses):+.4f} "
                    f"policy version {version} ({time.perf_counter() - started:.0f}s)")
            end_accuracy = accuracy(sampler, task, held_out, cfg.max_tokens, log)
            log(f"held-out greedy accuracy: {start_accuracy:.1%} -> {end_accuracy:.1%} "
                f"({end_accuracy - start_accuracy:+.1%}) after {cfg.steps} steps, {time.perf_counter() - started:.0f}s")
            return {"accuracy_start": start_accuracy, "accuracy_end": end_accuracy, "rewards": rewards_per_step,
                    "session_id": training.session_id}
        finally:
            training.unload().result()


def parse(argv: list[str]) -> LoopConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in LoopConfig.__dataclass_fields__.items():
        kind = float if isinstance(default.default, float) else int if isinstance(default.default, int) else str
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default.default)
    return LoopConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
