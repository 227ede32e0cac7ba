"""What a GRPO job's controller carries per step: the episodes and the batch through it, or handles and texts only.

    python -m bench.controller_path [--episodes 1024] [--completion-tokens 256] [--group-size 16] [--steps 5]
                                    [--trainer-procs 1] [--job-steps 40] [--job-repeats 1] [--old-rev 7c05541]

1. The data path, three ways in one run on the same actors: a Generator whose engine is replaced by synthetic
   completions (`--episodes` of `--completion-tokens` tokens a step, in groups of `--group-size`, each with a text of
   `--chars-per-token` characters a token: the controller scores texts), a real ReplayBufferActor, a TrainerActor
   whose step only reads the batch (the data path, not the training), and a scorer that answers zeros (the reference
   model's place). The generator's and the buffer's endpoints are the real ones.
   - old: the generator answers with the completions' tensors, the controller packs the episodes, has the scorer
     score them, adds them with their log-probs, receives the sampled TrainBatch and sends it to every trainer rank
     (apps.grpo before issue 57);
   - fetch: the same episodes from the controller, added naming the scorer (the buffer asks it); the buffer samples
     and the controller passes the trainer a handle to the buffer and the version (apps/grpo/scheduler.py);
   - direct: the generator keeps the completions and answers with their texts (`generate_kept`); the controller
     sends the buffer the rows, ids, rewards and advantages with a handle to the generator, and the buffer takes the
     tensors from it (`take_kept`); then as fetch (this revision's single-turn path).
   Every path makes the same episodes (all trained, rewards and advantages given), so the figures are the data
   path's. Bytes are the controller's actor messages both ways, each measured as Monarch pickles it (`flatten`), in a
   pass of their own; CPU is the controller's `time.process_time()` per step, the mean of `--steps` steps after one
   warm-up.
2. The tiny job (`configs/grpo_tiny.yaml`, no warm start or evaluation, `--job-steps` steps): this checkout against
   `--old-rev` unpacked into a temporary folder (git archive) and run with the same Python, alternated `--job-repeats`
   times; steps/s and controller CPU per step from each run's summary.json. `--job-steps 0` skips it.
Ratios are against old.
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

from collections import OrderedDict

from actors.generator import Generator
from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor, TrainStepResult
from forge.actor import ForgeActor, endpoint, rank0
from forge.provisioner import shutdown
from monarch._src.actor.pickle import flatten
from rl.types import CompletionBatch, EpisodeBatch, KeptEpisodes, KeptPart, SamplingParams, TrainBatch

ROOT = Path(__file__).resolve().parents[1]
PAD = 0
PATHS = ("old", "fetch", "direct")
KEEP_AT_MOST = 4  # kept batches on the generator: one is in flight at a time here


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


class PathGenerator(Generator):
    """Generator's own `generate_batch`, `generate_kept` and `take_kept`, around synthetic completions instead of an
    engine: `prompt_tokens` and `completion_tokens` tokens each, a text of `chars_per_token` characters a token."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, chars_per_token: int) -> None:
        self.shape = prompt_tokens, completion_tokens, chars_per_token
        self._kept, self._next_key = OrderedDict(), 0

    @endpoint
    async def setup(self) -> None:
        torch.set_num_threads(1)

    @endpoint
    async def teardown(self) -> None:
        pass

    async def _generate_batch(self, prompts: list, params: SamplingParams, min_policy_version: int) -> CompletionBatch:
        return synthetic_completions(len(prompts), params.n, *self.shape, version=min_policy_version)


class ZeroScorer(ForgeActor):
    """The reference model's `logprobs` endpoint, answering zeros."""

    @endpoint
    async def logprobs(self, episodes: EpisodeBatch, pad_id: int) -> torch.Tensor:
        return torch.zeros(len(episodes.completion_ids))


def synthetic_completions(prompts: int, n: int, prompt_tokens: int, completion_tokens: int, chars_per_token: int,
                          version: int) -> CompletionBatch:
    generator = torch.Generator().manual_seed(version)
    count = prompts * n
    tokens = count * completion_tokens
    return CompletionBatch(
        prompt_ids=torch.randint(1, 1000, (prompts * prompt_tokens,), dtype=torch.int32, generator=generator),
        prompt_lengths=torch.full((prompts,), prompt_tokens, dtype=torch.long),
        samples=torch.full((prompts,), n, dtype=torch.long),
        token_ids=torch.randint(1, 1000, (tokens,), dtype=torch.int32, generator=generator),
        lengths=torch.full((count,), completion_tokens, dtype=torch.long),
        logprobs=-torch.rand(tokens, generator=generator),
        policy_versions=torch.full((tokens,), version, dtype=torch.int32),
        texts=[f"{i:08d}".ljust(completion_tokens * chars_per_token, "x") for i in range(count)],
        finish_reasons=["length"] * count)


def message_bytes(*values: Any) -> int:
    """What these values weigh as one actor message (Monarch's pickler; an actor mesh, which Monarch's message
    pickling carries by reference, weighed as cloudpickle writes it)."""
    try:
        _, buffer = flatten(values, lambda _: False)
        return len(buffer.freeze())
    except Exception:
        return len(cloudpickle.dumps(values))


class Controller:
    """One step of each path; `counted` adds up the bytes of every message the controller sends or receives."""

    def __init__(self, generator: Any, buffer: Any, trainer: Any, scorer: Any, group_size: int,
                 count_bytes: bool) -> None:
        self.generator, self.buffer, self.trainer, self.scorer = generator, buffer, trainer, scorer
        self.group_size, self.count_bytes = group_size, count_bytes
        self.counted = 0

    def count(self, *values: Any) -> None:
        if self.count_bytes:
            self.counted += message_bytes(*values)

    def scores(self, count: int, version: int) -> tuple[list[int], list[int], list[float], list[float]]:
        """Episode ids, group ids, rewards and advantages, as the controller gives them (the same on every path)."""
        ids = [version * count + i for i in range(count)]
        return ids, [i // self.group_size for i in ids], [float(i % 2) for i in ids], [(i % 2) - 0.5 for i in ids]

    async def generated(self, count: int, version: int) -> EpisodeBatch:
        """The old paths: the completions' tensors come to the controller, which packs the episodes."""
        prompts, params = ["p"] * (count // self.group_size), SamplingParams(n=self.group_size)
        self.count(prompts, params, version)
        completions = await self.generator.generate_batch.call_one(prompts, params, version)
        self.count(completions)
        ids, groups, rewards, advantages = self.scores(len(completions.texts), version)
        return EpisodeBatch.from_completions(completions, episode_ids=ids, group_ids=groups, rewards=rewards,
                                             advantages=advantages)

    async def old_step(self, count: int, version: int) -> int:
        episodes = await self.generated(count, version)
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

    async def fetch_step(self, count: int, version: int) -> int:
        episodes = await self.generated(count, version)
        self.count(episodes, 0, self.scorer, PAD)
        self.count(await self.buffer.add.call_one(episodes, reserved=0, scorer=self.scorer, pad_id=PAD))
        return await self.train(version)

    async def direct_step(self, count: int, version: int) -> int:
        prompts, params = ["p"] * (count // self.group_size), SamplingParams(n=self.group_size)
        self.count(prompts, params, version, KEEP_AT_MOST)
        kept = await self.generator.generate_kept.call_one(prompts, params, version, keep_at_most=KEEP_AT_MOST)
        self.count(kept)
        ids, groups, rewards, advantages = self.scores(len(kept.texts), version)
        episodes = KeptEpisodes([KeptPart(self.generator, kept.key, list(range(len(ids))), ids, groups, rewards,
                                          advantages)])
        self.count(episodes, 0, self.scorer, PAD)
        self.count(await self.buffer.add.call_one(episodes, reserved=0, scorer=self.scorer, pad_id=PAD))
        return await self.train(version)

    async def train(self, version: int) -> int:
        """The trainer's ranks fetch the batch from the buffer: the controller passes a handle and a version."""
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
    generator = await PathGenerator.options(mesh_name="generator").as_actor(
        args.prompt_tokens, args.completion_tokens, args.chars_per_token)
    buffer = await ReplayBufferActor.options(mesh_name="replay_buffer").as_actor(
        batch_size=args.episodes, max_policy_age=10**6, sample_order="oldest")
    trainer = await PathTrainer.options(procs=args.trainer_procs, mesh_name="trainer").as_actor()
    scorer = await ZeroScorer.options(mesh_name="scorer").as_actor()
    figures: dict[str, dict[str, float]] = {}
    version = 0
    try:
        for path in PATHS:
            counting, timing = (Controller(generator, buffer, trainer, scorer, args.group_size, count_bytes=counted)
                                for counted in (True, False))
            step = getattr(timing, f"{path}_step")
            version = await getattr(counting, f"{path}_step")(args.episodes, version)
            version = await step(args.episodes, version)  # warm-up
            cpu, wall = [], []
            for _ in range(args.steps):
                started, cpu_started = time.perf_counter(), time.process_time()
                version = await step(args.episodes, version)
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
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--chars-per-token", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trainer-procs", type=int, default=1)
    parser.add_argument("--job-steps", type=int, default=40)
    parser.add_argument("--job-repeats", type=int, default=1)
    parser.add_argument("--old-rev", default="7c05541", help="the tiny job's other revision (default: before "
                        "the episodes went generator -> buffer)")
    args = parser.parse_args()

    if args.episodes % args.group_size:
        parser.error(f"--episodes={args.episodes} must be a multiple of --group-size={args.group_size}")
    figures = asyncio.run(data_path(args))
    old = figures["old"]
    print(f"data path per step, {args.episodes} episodes x {args.completion_tokens} tokens, "
          f"trainer x{args.trainer_procs}:")
    print(f"{'':8}{'controller bytes':>18}{'controller CPU s':>18}{'wall s':>10}{'bytes/old':>11}{'CPU/old':>9}")
    for name, f in figures.items():
        print(f"{name:8}{f['bytes']:>18,}{f['cpu_s']:>18.4f}{f['wall_s']:>10.3f}{f['bytes'] / old['bytes']:>11.4f}"
              f"{f['cpu_s'] / old['cpu_s']:>9.3f}")
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
