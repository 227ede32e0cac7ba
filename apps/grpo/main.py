"""Asynchronous GRPO: rollout loops and the training loop run concurrently, decoupled by the replay buffer.

    python -m apps.grpo --config configs/grpo_tiny.yaml [key=value ...] [--resume]

    prompt -> Generator service (R replicas) -> reward -> group advantages -> ReplayBuffer(max_policy_age)
           -> TorchTitan trainer -> publish version v+1 -> generators prefetch and swap it in.

Around the algorithm: apps/grpo/cli.py reads and checks the command line before this module's heavy imports,
launch.py starts the model and the actors, rewards.py scores, checkpoints.py and summary.py save and report the
run, and forge.lifecycle owns signals, actor failures, the exit code and the clean-up.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from actors.weight_canary import check_weight_sync
from apps.grpo.checkpoints import JobCheckpoints
from apps.grpo.config import GRPOConfig
from apps.grpo.launch import make_task, reward_function, start_actors
from apps.grpo.rewards import RewardHangError, RewardScorer
from apps.grpo.rollouts import EPISODE_BITS, held_out_score, make_rollout, warm_started_model
from apps.grpo.summary import EpisodeCounters, RunSummary
from forge import weight_store
from forge.actor import rank0
from rl.environments.threads import EnvironmentsBlocked
from forge.lifecycle import run_job
from forge.metrics import MetricLogger, record_metric
from forge.provisioner import get_provisioner
from forge.service import NoHealthyReplicaError
from rl.types import EpisodeBatch, SamplingParams, TrainBatch
from losses.advantages import group_advantages


class GRPOJob:
    def __init__(self, cfg: GRPOConfig, resume: bool) -> None:
        self.cfg, self.resume = cfg, resume
        self.run_dir = Path(cfg.run_dir)
        self.task = make_task(cfg)
        reward, timeout_s = reward_function(cfg, self.task)
        self.rewards = RewardScorer(reward, timeout_s, name=f"task.reward={cfg.task.reward}")
        self.checkpoints = JobCheckpoints(cfg.checkpoint.folder, cfg.checkpoint.keep)
        self.rng = random.Random(cfg.seed)
        self.counters = EpisodeCounters()
        self.summary = RunSummary(held_out_score=held_out_score(cfg, self.task))
        self.step = self.version = 0
        # The replay buffer decides how much rollout work may be under way (ReplayBuffer.reserve); these say when
        # to ask it again: `room` when something may have freed room (a batch sampled, a version published, a group
        # finished), `arrived` when episodes reached the buffer (the training loop may find a batch).
        self.room, self.arrived = asyncio.Event(), asyncio.Event()
        self._scored: list[EpisodeBatch] = []  # scored groups, on their way to the buffer
        self._buffer_writer = asyncio.Lock()  # one add in flight at a time
        self._unreleased, self._buffer_releaser = 0, asyncio.Lock()  # reserved room to give back; one release at a time
        self.rewards_this_step: list[float] = []
        self.groups_dropped_this_step = 0  # zero-variance groups dropped since the last training step
        self.stopping = asyncio.Event()
        self.interrupted: str | None = None  # the signal that asked the job to stop early

    def request_stop(self, reason: str) -> None:
        """Finish the current step, then wind down as at the end (checkpoint if configured, no evaluation)."""
        print(f"stopping after the current step{' and saving a checkpoint' if self.cfg.checkpoint.final else ''}",
              file=sys.stderr, flush=True)
        self.interrupted = reason
        self.stopping.set()

    async def run(self) -> None:
        cfg, wall_start = self.cfg, time.perf_counter()
        model_path, self.summary.warm_start_accuracy = await asyncio.to_thread(warm_started_model, cfg, self.task)
        # From here the controller's tensor work is small (packing episodes): intra-op threads would only spin-wait
        # after each op (OpenMP), which tripled its CPU per step on the tiny job.
        torch.set_num_threads(1)
        self.actors = await start_actors(cfg, model_path)
        self.rollout = await make_rollout(cfg, self.task, self.actors, self.rewards)  # single-turn or multi-turn episodes
        if self.resume:
            await self.restore()
        self.version = rank0(await self.actors.trainer.publish_weights.call())
        await self.actors.generators.update_weights.fanout(self.version)
        if cfg.eval.at_start and not self.interrupted:
            self.summary.accuracy_start = await self.evaluate("start")
        await self.train_while_generating()
        if cfg.eval.at_end and not self.interrupted:
            self.summary.accuracy_end = await self.evaluate("end")
        if cfg.checkpoint.final and self.summary.steps_this_run:
            saved = self.checkpoints.path(self.step)
            self.summary.checkpoint = str(saved if saved.exists() else await self.save_checkpoint())
        if not self.interrupted:
            self.summary.hf_model = str(self.run_dir / "hf_model")
            await self.actors.trainer.export_hf.call(self.summary.hf_model)
        s = self.summary
        s.count_episodes(self.counters, await self.actors.buffer.stats.call_one())
        s.steps, s.policy_version, s.interrupted = self.step, self.version, self.interrupted
        s.reward_failures = self.rewards.failures
        s.rss_end, s.shm_bytes = get_provisioner().memory_rss(), weight_store.job_segments_bytes()
        s.wall_s = time.perf_counter() - wall_start
        print(s.text(), flush=True)
        s.write(self.run_dir / "summary.json")

    async def train_while_generating(self) -> None:
        """The rollout loop fills the replay buffer while the training loop drains it."""
        rollouts, training = asyncio.ensure_future(self.rollout_loop()), asyncio.ensure_future(self.training_loop())
        try:
            done, _ = await asyncio.wait([training, rollouts], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a rollout that died takes the job down with its error
            await training  # rollouts end first only when asked to stop: the step in progress finishes
        finally:
            self.stopping.set()
            for task in [training, rollouts]:
                task.cancel()
            await asyncio.gather(training, rollouts, return_exceptions=True)

    # --- rollout -> reward -> group advantages -> buffer ------------------------------------------------
    async def rollout_loop(self) -> None:
        """Start prompt groups, each with the newest published version, as far as the replay buffer has room for
        their episodes (ReplayBuffer.reserve: what the trainer can still train within max_policy_age versions) and
        at most `rollout.concurrency` at once; otherwise wait until something may have freed room."""
        r = self.cfg.rollout
        params = SamplingParams(n=r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                stop_token_ids=list(self.task.stop_token_ids))
        groups: set[asyncio.Future] = set()
        try:
            while not self.stopping.is_set():
                self.room.clear()  # whatever frees room from here on sets it again: no change is missed
                for group in [g for g in groups if g.done()]:
                    groups.discard(group)
                    group.result()  # a group that failed (e.g. no healthy generator left) takes the job down
                wanted = r.concurrency - len(groups)
                if wanted:
                    version = self.version
                    last_version = version + self.cfg.steps - self.step - 1  # the job's last batch: nothing beyond it
                    granted = await self.actors.buffer.reserve.call_one(version, wanted, r.group_size, last_version)
                    for _ in range(granted):
                        group = asyncio.ensure_future(self.one_group(params, version))
                        group.add_done_callback(lambda _: self.room.set())
                        groups.add(group)
                await self._wait_for(self.room)
        finally:
            for group in groups:
                group.cancel()
            await asyncio.gather(*groups, return_exceptions=True)

    async def one_group(self, params: SamplingParams, version: int) -> None:
        """Generate one prompt's group with `version` or newer, score it and hand it to the buffer, or give its
        reserved room back."""
        episodes = await self.scored_group(params, version)
        if episodes is None:
            await self._release(params.n)
        else:
            await self._add_to_buffer(episodes)

    async def scored_group(self, params: SamplingParams, version: int) -> EpisodeBatch | None:
        """The group's episodes with rewards and advantages; None when generation failed or the group was dropped.

        A group with an episode whose environment failed is dropped whole (counted): that episode's reward says
        nothing of what the model wrote, so it cannot be trained, nor be the baseline of the others' advantages. The
        others could form a smaller group, but the replay buffer reserves and trains whole groups: with groups
        short of their size, the job's last batch could never be filled (a 3-step run hung after step 2)."""
        (problem,) = self.task.sample_prompts(1, self.rng)
        try:  # completions, or multi-turn trajectories (apps/grpo/rollouts.py), and their rewards
            completions, rewards, environment_failures = await self.rollout.group(problem, params, version)
        except (NoHealthyReplicaError, RewardHangError, EnvironmentsBlocked):
            raise
        except Exception as e:  # a per-request engine error (e.g. a prompt over the window) fails this group only
            self.counters.generation_failures += 1
            record_metric("rollout/generation_failures", 1, "sum")
            print(f"generation failed for prompt {problem.prompt[:60]!r}: {e}", file=sys.stderr)
            return None
        if environment_failures:
            self.counters.generated += len(rewards)
            self.counters.environment_failures += environment_failures
            self.counters.environment_dropped += len(rewards)
            record_metric("rollout/environment_failures", environment_failures, "sum")
            record_metric("rollout/environment_dropped", len(rewards), "sum")
            return None
        self.rewards_this_step.extend(rewards)
        budget = self.cfg.rollout.max_dropped_groups_per_step
        if (self.cfg.rollout.drop_zero_variance_groups and all(r == rewards[0] for r in rewards)
                and (budget is None or self.groups_dropped_this_step < budget)):
            self.groups_dropped_this_step += 1
            self.counters.generated += len(rewards)
            self.counters.zero_variance_dropped += len(rewards)
            record_metric("rollout/zero_variance_dropped", len(rewards), "sum")
            return None
        advantages, _ = group_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long),
                                         normalize_std=self.cfg.rollout.normalize_advantages)
        group_id = self.rng.getrandbits(62 - EPISODE_BITS)  # its episode ids (episode_ids) travel as int64
        episodes = self.rollout.to_episodes(completions, group_id=group_id, rewards=rewards,
                                            advantages=advantages.tolist())
        if self.actors.reference is not None:
            episodes.ref_logprobs = rank0(await self.actors.reference.logprobs.call(episodes, self.actors.pad_id))
        return episodes

    async def _release(self, count: int) -> None:
        """Give `count` reserved episodes back to the buffer. As with `_add_to_buffer`, releases that come while one
        is in flight go in one call after it: late in a run most groups may be dropped, and each would cost an actor
        message."""
        self._unreleased += count
        async with self._buffer_releaser:
            if self._unreleased:
                count, self._unreleased = self._unreleased, 0
                await self.actors.buffer.release.call_one(count)

    async def _add_to_buffer(self, group: EpisodeBatch) -> None:
        """Returns once `group` is in the buffer. Groups that finish while an add is in flight go in one call (one
        packed batch) after it: a generator batch finishes many groups at once, and one call per group cost the
        controller more CPU than everything else it does."""
        self._scored.append(group)
        async with self._buffer_writer:
            if self._scored:  # else an earlier caller's add took these
                episodes, self._scored = EpisodeBatch.cat(self._scored), []
                # Counted as they are sent: a job that stops with scored groups not yet sent counts them nowhere.
                self.counters.generated += len(episodes)
                await self.actors.buffer.add.call_one(episodes, reserved=True)
                self.arrived.set()

    # --- train -> publish -------------------------------------------------------------------------------
    async def training_loop(self) -> None:
        cfg, logger = self.cfg, MetricLogger.from_config(self.cfg.metrics, total_steps=self.cfg.steps,
                                                         jsonl_default=self.run_dir / "metrics.jsonl")
        start_step, loop_start, loop_cpu = self.step, time.perf_counter(), time.process_time()
        try:
            while self.step < cfg.steps and not self.interrupted:
                step_start, step_cpu = time.perf_counter(), time.process_time()
                batch = await self._next_batch()
                if batch is None:
                    break
                waited, trained_on = time.perf_counter() - step_start, self.version
                metrics = rank0(await self.actors.trainer.train_step.call(batch))
                self.version = int(metrics.pop("policy_version"))  # the trainer published it
                self.step += 1
                if cfg.canary.every and self.step % cfg.canary.every == 0:
                    metrics["canary/logprob_diff"] = await self.check_weight_sync()
                self.counters.trained += batch.num_sequences
                self.groups_dropped_this_step = 0  # dynamic sampling's budget is per step
                self.room.set()  # rollouts may start with the new version
                stats = await self.actors.buffer.stats.call_one()
                elapsed = time.perf_counter() - step_start
                rewards, self.rewards_this_step = self.rewards_this_step, []
                record = logger.log(self.step, await get_provisioner().collect_metrics(), {
                    "reward/mean": float(batch.rewards.mean()),
                    "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
                    "train/version_lag": float((trained_on - batch.oldest_policy_versions()).double().mean()),
                    "buffer/dropped_too_old": float(stats["dropped_too_old"]), "train/wait_s": waited,
                    "train/episodes_per_s": batch.num_sequences / elapsed, "step_s": elapsed,
                    "controller/cpu_s": time.process_time() - step_cpu,
                    "policy_version": float(self.version), **metrics})
                self.summary.step_logged(record, memory=get_provisioner().memory_rss)
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.steps:
                    await self.evaluate(f"step {self.step}")
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    await self.save_checkpoint()
        finally:
            logger.close()
        self.summary.train_s, self.summary.steps_this_run = time.perf_counter() - loop_start, self.step - start_step
        self.summary.controller_cpu_s = time.process_time() - loop_cpu

    async def _next_batch(self) -> TrainBatch | None:
        """The next batch for the current version (padded tensors); None when asked to stop while waiting."""
        while not self.interrupted:
            self.arrived.clear()  # episodes that reach the buffer from here on set it again
            batch = await self.actors.buffer.sample.call_one(self.version, self.actors.pad_id)
            self.room.set()  # the buffer handed out a batch or evicted stale episodes: rollouts may have room
            if batch is not None:
                return batch
            await self._wait_for(self.arrived)
        return None

    async def _wait_for(self, event: asyncio.Event) -> None:
        """Until `event` is set or the job is stopping."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def check_weight_sync(self) -> float:
        """The trainer and one generator score the first held-out prompt and its answer (actors/weight_canary.py)."""
        problem, tokenizer = self.task.held_out()[0], self.actors.tokenizer
        await self.actors.trainer.wait_published.call()
        return await check_weight_sync(self.actors.trainer, self.actors.generators, tokenizer.encode(problem.prompt),
                                       tokenizer.encode(problem.answer), self.cfg.canary.max_logprob_diff)

    # --- evaluation and checkpoints ---------------------------------------------------------------------
    async def evaluate(self, label: str) -> float:
        await self.actors.trainer.wait_published.call()  # the trainer publishes each version in the background
        await self.actors.generators.update_weights.fanout(self.version)  # the newest policy, not a lagging one
        problems = self.task.held_out()[: self.cfg.eval.num_prompts]
        params = SamplingParams(n=1, max_tokens=self.cfg.rollout.max_tokens, temperature=0.0,
                                stop_token_ids=list(self.task.stop_token_ids))
        played = await self.rollout.evaluate(problems, params)
        scores = [score for score in played if score is not None]  # None: its environment failed
        mean = sum(scores) / len(scores) if scores else math.nan
        failed = len(played) - len(scores)
        self.summary.eval_environment_failures += failed
        record_metric(self.summary.score_metric, mean)
        print(f"eval ({label}, policy version {self.version}): held-out greedy {self.summary.held_out_score} "
              f"{self.summary.score_text(mean)} on {len(scores)} prompts"
              + (f" ({failed} more left out: their environment failed)" if failed else ""), flush=True)
        return mean

    async def save_checkpoint(self) -> Path:
        state = {"step": self.step, "version": self.version, "rng": self.rng.getstate(),
                 "counters": asdict(self.counters), "buffer": await self.actors.buffer.state_dict.call_one()}
        return await self.checkpoints.save(self.step, self.actors.trainer, state)

    async def restore(self) -> None:
        path, state = await self.checkpoints.load_latest(self.actors.trainer)
        await self.actors.buffer.load_state_dict.call_one(state["buffer"])
        self.step, self.rng = state["step"], random.Random()
        self.rng.setstate(state["rng"])
        self.counters = EpisodeCounters(**state["counters"])
        print(f"resumed from {path}: step {self.step}, policy version {state['version']}", flush=True)


def run(cfg: GRPOConfig, resume: bool) -> int:
    """Run the job under forge.lifecycle: a first SIGINT/SIGTERM finishes the step and checkpoints."""
    job = GRPOJob(cfg, resume)
    return run_job(job.run, on_stop=job.request_stop)
