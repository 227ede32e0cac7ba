"""What a GRPO job's controller carries per step: the batch through it (the old path) or handles only (the new one).

    python -m bench.controller_path [--episodes 1024] [--completion-tokens 256] [--steps 5] [--trainer-procs 1]
                                    [--job-steps 40] [--job-repeats 1] [--old-rev 26b3d2a]

1. The data path, side by side in one run on the same actors: a real ReplayBufferActor, a TrainerActor whose step
   only reads the batch (the data path, not the training), and a scorer that answers zeros (the reference model's
   place). Each step adds `--episodes` synthetic episodes of `--completion-tokens` tokens and trains one batch of
   them.
   - old: the controller has the scorer score the episodes, adds them with their log-probs, receives the sampled
     TrainBatch and sends it to every trainer rank (how apps.grpo ran before issue 57);
   - new: the controller adds the episodes naming the scorer (the buffer asks it), has the buffer sample, and passes
     the trainer a handle to the buffer and the version (apps/grpo/scheduler.py).
   Bytes are the controller's actor messages both ways, each measured as Monarch pickles it (`flatten`), in a pass of
   their own; CPU is the controller's `time.process_time()` per step, the mean of `--steps` steps after one warm-up.
2. The tiny job (`configs/grpo_tiny.yaml`, no warm start or evaluation, `--job-steps` steps): this checkout against
   `--old-rev` unpacked into a temporary folder (git archive) and run with the same Python, alternated `--job-repeats`
   times; steps/s and controller CPU per step from each run's summary.json. `--job-steps 0` skips it.
Ratios are new / old.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor, TrainStepResult
from forge.actor import ForgeActor, endpoint, rank0
from forge.provisioner import shutdown
from monarch._src.actor.pickle import flatten
from rl.types import EpisodeBatch, TrainBatch

ROOT = Path(__file__).resolve().parents[1]
PAD = 0


class PathTrainer(TrainerActor):
    """TrainerActor's own `train_step` and `train_from`, around a step that only reads the batch."""

    def __init__(self) -> None:
        self.version = 0
        self._publisher = self._executor = None

    @endpoint
    async def setup(self) -> None:
        torch.set_num_threads(1)

    async def _train(self, batch: TrainBatch) -> TrainStepResult:
        self.version += 1
        return TrainStepResult(self.version, {"tokens": float(batch.response_mask.sum())})


class ZeroScorer(ForgeActor):
    """The reference model's `logprobs` endpoint, answering zeros."""

    @endpoint
    async def logprobs(self, episodes: EpisodeBatch, pad_id: int) -> torch.Tensor:
        return torch.zeros(len(episodes.completion_ids))


def synthetic_episodes(count: int, prompt_tokens: int, completion_tokens: int, version: int) -> EpisodeBatch:
    generator = torch.Generator().manual_seed(version)
    tokens = count * completion_tokens
    return EpisodeBatch(
        episode_ids=torch.arange(count, dtype=torch.long) + version * count,
        group_ids=torch.arange(count, dtype=torch.long) // 16,
        rewards=torch.rand(count, generator=generator), advantages=torch.randn(count, generator=generator),
        prompt_lengths=torch.full((count,), prompt_tokens, dtype=torch.long),
        completion_lengths=torch.full((count,), completion_tokens, dtype=torch.long),
        prompt_ids=torch.randint(1, 1000, (count * prompt_tokens,), dtype=torch.int32, generator=generator),
        completion_ids=torch.randint(1, 1000, (tokens,), dtype=torch.int32, generator=generator),
        behaviour_logprobs=-torch.rand(tokens, generator=generator),
        policy_versions=torch.full((tokens,), version, dtype=torch.int32))


def message_bytes(*values: Any) -> int:
    """What these values weigh as one actor message (Monarch's pickler; an actor mesh, which Monarch's message
    pickling carries by reference, weighed as cloudpickle writes it)."""
    try:
        _, buffer = flatten(values, lambda _: False)
        return len(buffer.freeze())
    except Exception:
        return len(cloudpickle.dumps(values))


class Controller:
    """One step of either path; `counted` adds up the bytes of every message the controller sends or receives."""

    def __init__(self, buffer: Any, trainer: Any, scorer: Any, count_bytes: bool) -> None:
        self.buffer, self.trainer, self.scorer, self.count_bytes = buffer, trainer, scorer, count_bytes
        self.counted = 0

    def count(self, *values: Any) -> None:
        if self.count_bytes:
            self.counted += message_bytes(*values)

    async def old_step(self, episodes: EpisodeBatch, version: int) -> int:
        self.count(episodes, PAD)
        ref = rank0(await self.scorer.logprobs.call(episodes, PAD))
        self.count(ref)
        episodes.ref_logprobs = ref
        self.count(episodes, 0)
        self.count(await self.buffer.add.call_one(episodes, reserved=0))
        self.count(version, PAD)  # `sample` then, the batch in its answer; here two calls, counted as that one
        await self.buffer.next_batch.call_one(version, PAD)
        batch = await self.buffer.batch.call_one(version)
        self.count(batch)
        results = await self.trainer.train_step.call(batch)
        for _ in results.values():  # one message to and from each rank
            self.count(batch)
        result = rank0(results)
        self.count(result)
        return result.version

    async def new_step(self, episodes: EpisodeBatch, version: int) -> int:
        self.count(episodes, 0, self.scorer, PAD)
        self.count(await self.buffer.add.call_one(episodes, reserved=0, scorer=self.scorer, pad_id=PAD))
        self.count(version, PAD)
        handed = await self.buffer.next_batch.call_one(version, PAD)
        self.count(handed)
        results = await self.trainer.train_from.call(self.buffer, handed.policy_version)
        for _ in results.values():
            self.count(self.buffer, handed.policy_version)
        result = rank0(results)
        self.count(result)
        return result.version


async def data_path(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)  # as the job's controller
    buffer = await ReplayBufferActor.options(mesh_name="replay_buffer").as_actor(
        batch_size=args.episodes, max_policy_age=10**6, sample_order="oldest")
    trainer = await PathTrainer.options(procs=args.trainer_procs, mesh_name="trainer").as_actor()
    scorer = await ZeroScorer.options(mesh_name="scorer").as_actor()
    figures: dict[str, dict[str, float]] = {}
    version = 0
    try:
        for path in ("old", "new"):
            counting = Controller(buffer, trainer, scorer, count_bytes=True)
            timing = Controller(buffer, trainer, scorer, count_bytes=False)
            step = getattr(timing, f"{path}_step")
            episodes = [synthetic_episodes(args.episodes, args.prompt_tokens, args.completion_tokens, v)
                        for v in range(version, version + args.steps + 2)]
            version = await getattr(counting, f"{path}_step")(episodes[0], version)
            version = await step(episodes[1], version)  # warm-up
            cpu, wall = [], []
            for batch in episodes[2:]:
                started, cpu_started = time.perf_counter(), time.process_time()
                version = await step(batch, version)
                cpu.append(time.process_time() - cpu_started)
                wall.append(time.perf_counter() - started)
            figures[path] = {"bytes": counting.counted, "cpu_s": statistics.mean(cpu), "wall_s": statistics.mean(wall)}
    finally:
        await shutdown()
    return figures


def run_job(checkout: Path, run_dir: Path, steps: int) -> dict[str, float]:
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"run_dir={run_dir}",
               f"steps={steps}", "warm_start.enabled=false", "eval.at_start=false", "eval.at_end=false",
               "checkpoint.final=false"]
    # The checkout's code first, in the controller and in every process it spawns (they inherit the environment).
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"steps_per_s": summary["steps_this_run"] / summary["train_s"],
            "cpu_per_step": summary["controller_cpu_s"] / summary["steps_this_run"]}


def tiny_job(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="controller_path_") as scratch:
        old = Path(scratch) / "old"
        old.mkdir()
        # The old revision's files only (git archive): the repository's worktrees and index are left alone.
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old_rev], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        if (ROOT / ".cache").exists():  # the tiny model, built once
            (old / ".cache").symlink_to(ROOT / ".cache")
        for repeat in range(args.job_repeats):
            for path, checkout in (("old", old), ("new", ROOT)):
                runs[path].append(run_job(checkout, Path(scratch) / f"{path}{repeat}", args.job_steps))
                print(f"  tiny job {path} #{repeat}: {runs[path][-1]}", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trainer-procs", type=int, default=1)
    parser.add_argument("--job-steps", type=int, default=40)
    parser.add_argument("--job-repeats", type=int, default=1)
    parser.add_argument("--old-rev", default="26b3d2a", help="the revision before the scheduler (issue 57)")
    args = parser.parse_args()

    figures = asyncio.run(data_path(args))
    old, new = figures["old"], figures["new"]
    print(f"data path per step, {args.episodes} episodes x {args.completion_tokens} tokens, "
          f"trainer x{args.trainer_procs}:")
    print(f"{'':8}{'controller bytes':>18}{'controller CPU s':>18}{'wall s':>10}")
    for name, f in figures.items():
        print(f"{name:8}{f['bytes']:>18,}{f['cpu_s']:>18.4f}{f['wall_s']:>10.3f}")
    print(f"{'new/old':8}{new['bytes'] / old['bytes']:>18.5f}{new['cpu_s'] / old['cpu_s']:>18.3f}"
          f"{new['wall_s'] / old['wall_s']:>10.3f}")
    if args.job_steps:
        runs = tiny_job(args)
        means = {path: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for path, rs in runs.items()}
        print(f"tiny job, {args.job_steps} steps, {args.job_repeats} run(s) each, alternated:")
        for path, m in means.items():
            print(f"{path:8}{m['steps_per_s']:>10.3f} steps/s{m['cpu_per_step']:>10.4f} controller CPU s/step")
        print(f"{'new/old':8}{means['new']['steps_per_s'] / means['old']['steps_per_s']:>10.3f}"
              f"{'':8}{means['new']['cpu_per_step'] / means['old']['cpu_per_step']:>10.3f}")


if __name__ == "__main__":
    main()
