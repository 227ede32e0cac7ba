"""Asynchronous GRPO: rollout loops and the training loop run concurrently, decoupled by the replay buffer.

    python -m apps.grpo --config configs/grpo_tiny.yaml [key=value ...] [--resume]

dataset -> Generator service (R replicas) -> reward -> group advantages -> ReplayBuffer(max_policy_age)
        -> TorchTitan trainer -> publish version v+1 -> generators prefetch and swap it in.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoTokenizer

from actors.generator import Generator
from actors.reference_model import ReferenceActor, ReferenceConfig
from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor
from apps.grpo.config import GRPOConfig
from forge import weight_store
from forge.actor import rank0
from forge.config import ConfigError, load_config, parse_args, to_yaml, validate
from forge.metrics import JsonlBackend, MetricLogger, record_metric
from forge.provisioner import get_provisioner, kill_job_processes, shutdown
from forge.service import NoHealthyReplicaError
from forge.tasks import ArithmeticTask, load_callable
from forge.tiny_model import ensure_tiny_checkpoint
from forge.types import Episode, SamplingParams
from forge.warm_start import warm_start
from losses.advantages import group_advantages

WEIGHTS = "policy"
CONSOLE_KEYS = ["reward/mean", "train/version_lag", "buffer/dropped_too_old", "generator/tokens_per_s",
                "train/episodes_per_s", "step_s", "loss"]


# --- configuration -------------------------------------------------------------------------------------
def load_job_config(argv: list[str]) -> tuple[GRPOConfig, bool]:
    """Parse, resolve `model: tiny` to the built checkpoint, validate: every config error before any process."""
    path, overrides, args = parse_args(argv, description=__doc__.splitlines()[0])
    cfg = load_config(path, overrides)
    if cfg.get("model", "tiny") == "tiny":
        tiny = ensure_tiny_checkpoint(Path(cfg.get("model_cache", ".cache/forge")) / "tiny-qwen3")
        cfg = load_config(path, [*overrides, f"model={tiny}"])
    job = validate(cfg, GRPOConfig)
    if job.task.reward:
        load_callable(job.task.reward, field="task.reward")  # importable, before any process starts
    return job, bool(args.resume or job.resume)


def check_resources(cfg: GRPOConfig) -> None:
    if not cfg.resources.with_gpus:
        return
    r = cfg.resources
    wanted = r.generator_replicas * r.generator_procs + r.trainer_procs + (r.reference_procs if cfg.reference.enabled else 0)
    have = torch.cuda.device_count()
    if wanted > have:
        raise ConfigError(
            f"resources: the layout needs {wanted} GPUs (generator_replicas={r.generator_replicas} x generator_procs="
            f"{r.generator_procs} + trainer_procs={r.trainer_procs}"
            f"{f' + reference_procs={r.reference_procs}' if cfg.reference.enabled else ''}) but {have} are visible"
        )


def make_task(cfg: GRPOConfig):
    if cfg.task.name == "arithmetic":
        return ArithmeticTask(seed=cfg.seed, num_digits=cfg.task.num_digits, held_out=cfg.task.held_out,
                              reverse_answer=cfg.task.reverse_answer)
    from forge.tasks.gsm8k import GSM8KTask

    return GSM8KTask(cfg.task.dataset, config=cfg.task.dataset_config, train_split=cfg.task.train_split,
                     eval_split=cfg.task.eval_split, held_out=cfg.task.held_out, seed=cfg.seed)


# --- rewards -------------------------------------------------------------------------------------------
class RewardScorer:
    """Scores completions; a reward that raises, returns NaN or (on the thread pool) hangs past its timeout
    scores 0 and is counted, and each kind of failure is printed once.

    A user's reward (`task.reward`) runs on the scorer's own threads under `timeout_s`, so one that hangs ties
    up none of asyncio's. The task's built-in exact-match reward (`timeout_s=None`) runs inline: it cannot
    hang, and a thread hand-off per completion cost the controller more CPU than the reward itself."""

    def __init__(self, fn: Callable[[str, str], float], timeout_s: float | None, threads: int = 32) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        self.failures = 0
        self._reported: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward") if timeout_s else None

    async def score(self, texts: list[str], answer: str) -> list[float]:
        """One reward per completion of the same prompt."""
        if self._executor is None:
            return [self._inline(text, answer) for text in texts]
        return list(await asyncio.gather(*(self._on_thread(text, answer) for text in texts)))

    def _inline(self, text: str, answer: str) -> float:
        try:
            return _valid_reward(self.fn(text, answer))
        except Exception as e:
            return self._failed(e)

    async def _on_thread(self, text: str, answer: str) -> float:
        loop = asyncio.get_running_loop()
        try:
            return _valid_reward(await asyncio.wait_for(loop.run_in_executor(self._executor, self.fn, text, answer),
                                                        self.timeout_s))
        except Exception as e:
            return self._failed(e)

    def _failed(self, error: Exception) -> float:
        self.failures += 1
        record_metric("reward/failures", 1, "sum")
        kind = type(error).__name__
        if kind not in self._reported:  # each kind of failure is shown once, with its traceback
            self._reported.add(kind)
            detail = (f"timed out after {self.timeout_s}s" if isinstance(error, asyncio.TimeoutError)
                      else "".join(traceback.format_exception(error)))
            print(f"reward function failed ({kind}); scoring as 0 and continuing:\n{detail}", file=sys.stderr)
        return 0.0


def _valid_reward(value: object) -> float:
    value = float(value)
    if math.isnan(value):
        raise ValueError("reward returned NaN")
    return value


# --- the job -------------------------------------------------------------------------------------------
@dataclass
class Counters:
    generated: int = 0  # episodes scored
    zero_variance_dropped: int = 0
    trained: int = 0
    generation_failures: int = 0


class GRPOJob:
    def __init__(self, cfg: GRPOConfig, resume: bool) -> None:
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.task = make_task(cfg)
        reward_fn = load_callable(cfg.task.reward, field="task.reward") if cfg.task.reward else self.task.reward
        self.rewards = RewardScorer(reward_fn, cfg.task.reward_timeout_s if cfg.task.reward else None)
        self.rng = random.Random(cfg.seed)
        self.counters = Counters()
        self.step = 0
        self.version = 0
        self.in_flight_groups = 0
        self.held_episodes = 0
        self.capacity = asyncio.Condition()
        self._pending_episodes: list[Episode] = []  # scored, on their way to the buffer
        self._buffer_writer = asyncio.Lock()  # one add in flight at a time
        self.stop = asyncio.Event()
        self.interrupted: str | None = None  # the signal that asked the job to stop early
        self.rewards_this_step: list[float] = []
        self.summary: dict[str, Any] = {}

    def request_stop(self, reason: str) -> None:
        """Finish the current step, then wind down as at the end (checkpoint if configured, no evaluation)."""
        self.interrupted = reason
        self.stop.set()

    # -- set-up --
    async def start(self) -> None:
        cfg = self.cfg
        model = cfg.model
        if cfg.warm_start.enabled and cfg.task.name == "arithmetic":
            model, accuracy = await asyncio.to_thread(self._warm_start)
            self.summary["warm_start_accuracy"] = accuracy
        self.model_path = str(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        r = cfg.resources
        provisioner = get_provisioner()
        await provisioner.start_weight_store()
        trainer_cfg = replace(cfg.trainer, model_path=self.model_path, max_steps=max(cfg.trainer.max_steps, cfg.steps))
        generator_cfg = replace(cfg.generator, model=self.model_path, weight_namespace=WEIGHTS)
        print(f"starting actors: trainer x{r.trainer_procs}, generator x{r.generator_replicas} replicas, replay buffer"
              f"{', reference' if cfg.reference.enabled else ''}", flush=True)
        spawns = [
            TrainerActor.options(procs=r.trainer_procs, with_gpus=r.with_gpus, mesh_name="trainer").as_actor(
                trainer_cfg, weight_namespace=WEIGHTS),
            ReplayBufferActor.options(mesh_name="replay_buffer").as_actor(cfg.replay_buffer),
            Generator.options(num_replicas=r.generator_replicas, procs=r.generator_procs, with_gpus=r.with_gpus,
                              mesh_name="generator").as_service(generator_cfg),
        ]
        if cfg.reference.enabled:
            ref_cfg = ReferenceConfig(model_path=self.model_path, family=cfg.trainer.family, dtype=cfg.trainer.dtype,
                                      device=cfg.trainer.device, temperature=cfg.trainer.temperature,
                                      chunk_rows=cfg.reference.chunk_rows)
            spawns.append(ReferenceActor.options(procs=r.reference_procs, with_gpus=r.with_gpus,
                                                 mesh_name="reference").as_actor(ref_cfg))
        actors = await asyncio.gather(*spawns)
        for mesh in provisioner.meshes.values():  # which process is which, for ps/top/py-spy and fault reports
            print(f"provisioned mesh {mesh.name}: {len(mesh.pids)} procs (pids {mesh.pids})"
                  f"{f', gpus {mesh.gpus}' if mesh.gpus else ''}", flush=True)
        self.trainer, self.buffer, self.generators = actors[:3]
        self.reference = actors[3] if cfg.reference.enabled else None

    def _warm_start(self) -> tuple[Path, float]:
        eval_rng = random.Random(f"{self.cfg.seed}-warm-start-eval")
        eval_problems = self.task.sample_prompts(self.cfg.warm_start.eval_prompts, eval_rng)
        train_rng = random.Random(f"{self.cfg.seed}-warm-start")
        return warm_start(self.cfg.model, Path(self.cfg.model_cache) / "warm_start",
                          train_problems=lambda n: self.task.sample_prompts(n, train_rng),
                          eval_problems=eval_problems, reward=self.task.reward, config=self.cfg.warm_start,
                          seed=self.cfg.seed, max_tokens=self.cfg.rollout.max_tokens)

    # -- evaluation --
    async def evaluate(self, label: str) -> float:
        await self.generators.update_weights.fanout(self.version)  # evaluate the newest policy, not a lagging one
        problems = self.task.held_out()[: self.cfg.eval.num_prompts]
        params = SamplingParams(n=1, max_tokens=self.cfg.rollout.max_tokens, temperature=0.0)
        chunk = max(1, math.ceil(len(problems) / max(1, len(self.generators.healthy_replicas()))))
        parts = [problems[i : i + chunk] for i in range(0, len(problems), chunk)]
        outputs = await asyncio.gather(*(self.generators.generate_batch.route([p.prompt for p in part], params) for part in parts))
        completions = [out[0] for part_out in outputs for out in part_out]
        scored = await asyncio.gather(*(self.rewards.score([c.text], p.answer) for c, p in zip(completions, problems)))
        scores = [score for (score,) in scored]
        accuracy = sum(scores) / len(scores)
        record_metric("eval/accuracy", accuracy)
        print(f"eval ({label}, policy version {self.version}): held-out greedy accuracy {accuracy:.1%} "
              f"on {len(problems)} prompts", flush=True)
        return accuracy

    # -- rollouts --
    def _groups_allowed(self) -> int:
        """Groups held or in flight. Each is generated by the newest published version v (the generators fetch
        it first) and trained at version v + max_policy_age at the latest: the trainer is at most one step past
        v when it starts, and max_policy_age - 1 full batches are ahead of it in the buffer. So none ages out.
        max_policy_age = 0 (synchronous) generates one batch at a time, between training steps."""
        per_step = self.cfg.replay_buffer.batch_size // self.cfg.rollout.group_size
        return per_step * max(1, self.cfg.replay_buffer.max_policy_age)

    async def rollout_loop(self) -> None:
        cfg = self.cfg
        params = SamplingParams(n=cfg.rollout.group_size, max_tokens=cfg.rollout.max_tokens,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
        while not self.stop.is_set():
            # Staleness bound (see _groups_allowed): admitted groups are trained within max_policy_age versions.
            async with self.capacity:
                await self.capacity.wait_for(lambda: self.stop.is_set() or self.in_flight_groups
                                             + self.held_episodes // cfg.rollout.group_size < self._groups_allowed())
                if self.stop.is_set():
                    return
                self.in_flight_groups += 1
            try:
                await self._one_group(params)
            finally:
                async with self.capacity:
                    self.in_flight_groups -= 1
                    self.capacity.notify_all()

    async def _one_group(self, params: SamplingParams) -> None:
        (problem,) = self.task.sample_prompts(1, self.rng)
        try:
            completions = await self.generators.generate.route(problem.prompt, params,
                                                               min_policy_version=self.version)
        except NoHealthyReplicaError:
            raise
        except Exception as e:  # a per-request engine error (e.g. a prompt over the window) fails this group only
            self.counters.generation_failures += 1
            record_metric("rollout/generation_failures", 1, "sum")
            print(f"generation failed for prompt {problem.prompt[:60]!r}: {e}", file=sys.stderr)
            return
        rewards = await self.rewards.score([c.text for c in completions], problem.answer)
        self.counters.generated += len(completions)
        self.rewards_this_step.extend(rewards)
        reward_t = torch.tensor(rewards)
        advantages, zero_variance = group_advantages(reward_t, torch.zeros(len(rewards), dtype=torch.long),
                                                     normalize_std=self.cfg.rollout.normalize_advantages)
        if self.cfg.rollout.drop_zero_variance_groups and bool(zero_variance.all()):
            self.counters.zero_variance_dropped += len(completions)
            record_metric("rollout/zero_variance_dropped", len(completions), "sum")
            return
        group_id = self.rng.getrandbits(62)
        episodes = [Episode.from_completion(c, episode_id=group_id * 64 + i, group_id=group_id, reward=r,
                                            advantage=float(a))
                    for i, (c, r, a) in enumerate(zip(completions, rewards, advantages))]
        if self.reference is not None:
            ref = rank0(await self.reference.logprobs.call(episodes, self.pad_id))
            for episode, logprobs in zip(episodes, ref):
                episode.ref_logprobs = logprobs
        await self._add_to_buffer(episodes)

    async def _add_to_buffer(self, episodes: list[Episode]) -> None:
        """Returns once `episodes` are in the buffer. Groups that finish while an add is in flight go in one
        call after it: a generator batch finishes many groups at once, and one RPC per group cost the
        controller more CPU than everything else it does."""
        self._pending_episodes.extend(episodes)
        async with self._buffer_writer:
            if not self._pending_episodes:
                return  # an earlier caller's add took these
            episodes, self._pending_episodes = self._pending_episodes, []
            held = await self.buffer.add.call_one(episodes)
        async with self.capacity:
            self.held_episodes = held
            self.capacity.notify_all()

    # -- training --
    async def training_loop(self, logger: MetricLogger) -> None:
        cfg = self.cfg
        start_step, job_start = self.step, time.perf_counter()
        while self.step < cfg.steps and not self.interrupted:
            step_start = time.perf_counter()
            batch = await self.buffer.sample.call_one(self.version)
            while batch is None and not self.interrupted:
                # sample() may have evicted stale episodes: refresh the held count, or rollouts would keep
                # waiting for capacity that is already free while this loop waits for a batch.
                held = (await self.buffer.stats.call_one())["held"]
                async with self.capacity:
                    self.held_episodes = held
                    self.capacity.notify_all()
                    try:
                        await asyncio.wait_for(self.capacity.wait(), timeout=0.05)
                    except asyncio.TimeoutError:
                        pass
                batch = await self.buffer.sample.call_one(self.version)
            if batch is None:
                break
            waited = time.perf_counter() - step_start
            episodes = [e for shard in batch for e in shard]
            if cfg.replay_buffer.max_policy_age > 0:  # generation of the next batch overlaps this step
                async with self.capacity:
                    self.held_episodes = max(0, self.held_episodes - len(episodes))
                    self.capacity.notify_all()
            trained_on = self.version
            metrics = rank0(await self.trainer.train_step.call(episodes, self.pad_id))
            self.version = int(metrics.pop("policy_version"))
            self.step += 1
            self.counters.trained += len(episodes)
            stats = await self.buffer.stats.call_one()
            async with self.capacity:
                self.held_episodes = stats["held"]
                self.capacity.notify_all()
            elapsed = time.perf_counter() - step_start
            rewards, self.rewards_this_step = self.rewards_this_step, []
            extra = {
                "reward/mean": sum(e.reward for e in episodes) / len(episodes),
                "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
                "train/version_lag": sum(trained_on - e.oldest_policy_version for e in episodes) / len(episodes),
                "buffer/dropped_too_old": float(stats.get("dropped_too_old", 0)),
                "train/wait_s": waited,
                "train/episodes_per_s": len(episodes) / elapsed,
                "step_s": elapsed,
                "policy_version": float(self.version),
                **metrics,
            }
            record = logger.log(self.step, await get_provisioner().collect_metrics(), extra)
            if "first_step" not in self.summary:
                self.summary["rss_start"] = get_provisioner().memory_rss()
            self.summary.setdefault("first_step", record)
            self.summary["last_step"] = record
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.steps:
                await self.evaluate(f"step {self.step}")
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                await self.save_checkpoint()
        self.summary["train_s"] = time.perf_counter() - job_start
        self.summary["steps_this_run"] = self.step - start_step

    # -- checkpoints --
    def _checkpoint_root(self) -> Path:
        return Path(self.cfg.checkpoint.folder)

    async def save_checkpoint(self) -> Path:
        root = self._checkpoint_root()
        target, partial = root / f"step_{self.step:06d}", root / f"step_{self.step:06d}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        await self.trainer.save_checkpoint.call(str(partial / "trainer"))
        state = {"step": self.step, "version": self.version, "rng": self.rng.getstate(),
                 "counters": asdict(self.counters), "buffer": await self.buffer.state_dict.call_one(),
                 "model_path": self.model_path}
        (partial / "job_state.pkl").write_bytes(pickle.dumps(state))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # a checkpoint is complete or absent, never half-written
        for old in sorted(root.glob("step_*[0-9]"))[: -self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"checkpoint: {target}", flush=True)
        return target

    async def _latest_checkpoint(self) -> Path:
        done = sorted(p for p in self._checkpoint_root().glob("step_*[0-9]") if (p / "job_state.pkl").exists())
        if not done:
            raise FileNotFoundError(f"--resume: no checkpoint in {self._checkpoint_root()} (checkpoint.folder)")
        return done[-1]

    async def restore(self) -> None:
        path = await self._latest_checkpoint()
        older = [p.name for p in sorted(self._checkpoint_root().glob("step_*[0-9]")) if p != path]
        try:
            state = pickle.loads((path / "job_state.pkl").read_bytes())
            await self.trainer.load_checkpoint.call(str(path / "trainer"))
        except Exception as e:
            raise RuntimeError(f"--resume: checkpoint {path} is corrupt or incomplete ({type(e).__name__}: {e}); "
                               f"move it aside to resume from an earlier one ({', '.join(older) or 'none left'})") from None
        await self.buffer.load_state_dict.call_one(state["buffer"])
        self.step, self.rng = state["step"], random.Random()
        self.rng.setstate(state["rng"])
        self.counters = Counters(**state["counters"])
        self.held_episodes = len(state["buffer"].get("episodes", []))
        print(f"resumed from {path}: step {self.step}, policy version {state['version']}", flush=True)

    # -- the whole run --
    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall_start = time.perf_counter()
        await self.start()
        if self.resume:
            await self.restore()
        self.version = rank0(await self.trainer.publish_weights.call())
        await self.generators.update_weights.fanout(self.version)
        if cfg.eval.at_start and not self.interrupted:
            self.summary["accuracy_start"] = await self.evaluate("start")
        logger = MetricLogger.from_config(cfg.metrics, total_steps=cfg.steps)
        if not cfg.metrics.jsonl:
            logger.backends.append(JsonlBackend(self.run_dir / "metrics.jsonl"))
        rollouts = [asyncio.ensure_future(self.rollout_loop()) for _ in range(cfg.rollout.concurrency)]
        try:
            training = asyncio.ensure_future(self.training_loop(logger))
            done, _ = await asyncio.wait([training, *rollouts], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a rollout loop that died takes the job down with its error
            await training  # rollouts end first only when asked to stop: the step in progress finishes
        finally:
            self.stop.set()
            async with self.capacity:
                self.capacity.notify_all()
            for task in rollouts:
                task.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
            logger.close()
        if cfg.eval.at_end and not self.interrupted:
            self.summary["accuracy_end"] = await self.evaluate("end")
        if cfg.checkpoint.final and self.summary.get("steps_this_run"):
            saved = self._checkpoint_root() / f"step_{self.step:06d}"
            self.summary["checkpoint"] = str(saved if saved.exists() else await self.save_checkpoint())
        export = self.run_dir / "hf_model"
        if not self.interrupted:
            await self.trainer.export_hf.call(str(export))
        stats = await self.buffer.stats.call_one()
        self.summary.update(
            steps=self.step, policy_version=self.version, wall_s=time.perf_counter() - wall_start, hf_model=str(export),
            episodes={"generated": self.counters.generated, "trained": self.counters.trained,
                      "consumed_by_buffer": stats["consumed"], "held_in_buffer": stats["held"],
                      "dropped_too_old": stats["dropped_too_old"], "dropped_buffer_full": stats["dropped_buffer_full"],
                      "dropped_zero_variance": self.counters.zero_variance_dropped},
            reward_failures=self.rewards.failures, generation_failures=self.counters.generation_failures,
            interrupted=self.interrupted, rss_end=get_provisioner().memory_rss(),
            shm_bytes=weight_store.job_segments_bytes(),
        )
        return self.summary



def print_summary(summary: dict[str, Any]) -> None:
    first, last = summary.get("first_step", {}), summary.get("last_step", {})
    lines = ["", "=== GRPO run summary ===",
             f"steps: {summary['steps']} (policy version {summary['policy_version']}), wall time {summary['wall_s']:.0f}s"]
    if "warm_start_accuracy" in summary:
        lines.append(f"warm start: greedy accuracy {summary['warm_start_accuracy']:.1%} (on its own eval prompts)")
    if "accuracy_start" in summary and "accuracy_end" in summary:
        gain = summary["accuracy_end"] - summary["accuracy_start"]
        lines.append(f"held-out accuracy: {summary['accuracy_start']:.1%} -> {summary['accuracy_end']:.1%} ({gain:+.1%})")
    if first and last:
        lines.append(f"reward (batch mean): first step {first.get('reward/mean', float('nan')):.3f} -> "
                     f"last step {last.get('reward/mean', float('nan')):.3f}")
    if summary.get("train_s"):
        lines.append(f"throughput: {summary['steps_this_run'] / summary['train_s']:.2f} steps/s, "
                     f"{summary['episodes']['trained'] / summary['train_s']:.1f} trained episodes/s")
    e = summary["episodes"]
    lines.append(f"episodes: generated {e['generated']} = trained {e['trained']} + held {e['held_in_buffer']} "
                 f"+ dropped (too old {e['dropped_too_old']}, buffer full {e['dropped_buffer_full']}, "
                 f"zero-variance {e['dropped_zero_variance']}); reward failures {summary['reward_failures']}")
    if summary.get("rss_start"):
        start, end = summary["rss_start"], summary["rss_end"]
        lines.append("resident memory, first step -> end (MB): " + ", ".join(
            f"{name} {start[name] / 2**20:.0f} -> {end[name] / 2**20:.0f}" for name in start if name in end)
            + f"; weight store shared memory {summary['shm_bytes'] / 2**20:.1f} MB")
    if summary.get("checkpoint"):
        lines.append(f"checkpoint: {summary['checkpoint']}  (resume with --resume)")
    if summary.get("interrupted"):
        lines.append(f"interrupted by {summary['interrupted']} after step {summary['steps']}: no final evaluation or export")
    else:
        lines.append(f"exported HF model: {summary['hf_model']}")
    print("\n".join(lines), flush=True)


EXIT_DEADLINE_S = 25.0  # every way out (signal, fatal failure, the end) leaves the process within this


def _exit_by_deadline(seconds: float, code: list[int]) -> None:
    """A daemon thread that ends the process if shutting down takes longer than `seconds`: a Monarch call
    to a dead process never answers, and a job must not hang on it."""

    def expire() -> None:
        time.sleep(seconds)
        print(f"shutdown did not finish within {seconds:.0f}s: killing the job's processes", file=sys.stderr, flush=True)
        kill_job_processes()
        os._exit(code[0])

    threading.Thread(target=expire, daemon=True, name="exit-deadline").start()


async def main_async(cfg: GRPOConfig, resume: bool) -> int:
    provisioner = get_provisioner()
    job = GRPOJob(cfg, resume)
    main = asyncio.ensure_future(job.run())
    watchdog = asyncio.ensure_future(provisioner.wait_for_fatal_failure())
    loop = asyncio.get_running_loop()
    code = [1]

    def on_signal(sig: signal.Signals) -> None:
        code[0] = 128 + sig.value
        if job.interrupted:  # a second signal: stop now
            print(f"\n{sig.name} again: exiting now", file=sys.stderr, flush=True)
            kill_job_processes()
            os._exit(code[0])
        print(f"\n{sig.name}: stopping after the current step"
              f"{' and saving a checkpoint' if cfg.checkpoint.final else ''} (again to exit at once)",
              file=sys.stderr, flush=True)
        job.request_stop(sig.name)
        _exit_by_deadline(EXIT_DEADLINE_S, code)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        done, _ = await asyncio.wait([main, watchdog], return_when=asyncio.FIRST_COMPLETED)
        if watchdog in done:
            failure = watchdog.result()
            main.cancel()
            print(f"\nFATAL: actor mesh {failure.mesh_name!r} failed; stopping the job.\n{failure.message}",
                  file=sys.stderr, flush=True)
            code[0] = 1
            return 1
        summary = main.result()
        print_summary(summary)
        (Path(cfg.run_dir) / "summary.json").write_text(
            json.dumps({k: v for k, v in summary.items() if k not in ("first_step", "last_step")}, indent=2, default=str))
        code[0] = 0 if not job.interrupted else code[0]
        return code[0]
    except Exception:
        print("\nFATAL: the job failed:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
        code[0] = 1
        return 1
    finally:
        watchdog.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if not job.interrupted:
            _exit_by_deadline(EXIT_DEADLINE_S, code)
        try:
            await asyncio.wait_for(shutdown(), timeout=EXIT_DEADLINE_S - 5)
        except Exception as e:  # the deadline thread cleans up whatever is left
            print(f"shutdown incomplete ({type(e).__name__}); killing what is left", file=sys.stderr, flush=True)
            kill_job_processes()
        if not main.done():
            # A task stuck on a call to a dead process would keep asyncio.run from returning.
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code[0])


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = load_job_config(sys.argv[1:] if argv is None else argv)
        check_resources(cfg)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    return asyncio.run(main_async(cfg, resume))
