"""Asynchronous GRPO: the rollout side and the training loop run concurrently, decoupled by the replay buffer.

    python -m apps.grpo --config configs/grpo_tiny.yaml [key=value ...] [--resume]

    prompt -> Generator service (R replicas) -> reward -> group advantages -> ReplayBuffer(max_policy_age)
           -> TorchTitan trainer -> publish version v+1 -> generators prefetch and swap it in.

Around the algorithm: apps/grpo/cli.py reads and checks the command line before this module's heavy imports,
launch.py starts the model and the actors, rollouts.py plays and scores groups and says which are trained,
scheduler.py runs the rollout loop and the training loop concurrently (the buffer's room bounds the rollout work; the
trainer fetches each batch from the buffer), checkpoints.py and summary.py save and report the run, and forge.lifecycle owns signals, actor failures, the exit
code and the clean-up.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from actors.replay_buffer import Added
from actors.weight_canary import check_weight_sync
from apps.run_checkpoints import JobCheckpoints
from apps.grpo.config import GRPOConfig
from apps.grpo.kl_watch import ReverseKLWatch
from apps.grpo.launch import make_task, start_actors
from apps.grpo.rollouts import (EPISODE_BITS, GroupSelector, HeldOut, held_out_score, make_rollout, sampling_params,
                                teacher_model, warm_started_model)
from apps.grpo.scheduler import RolloutScheduler, TrainedStep
from apps.grpo.summary import EpisodeCounters, RunSummary, step_record
from forge.actor import rank0
from forge.lifecycle import run_job
from forge.metrics import MetricLogger, record_metric
from forge.provisioner import get_provisioner
from losses.advantages import group_advantages
from rl.rollout import buffer_episodes
from rl.types import EpisodeBatch, KeptEpisodes


class GRPOJob:
    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg, self.task = cfg, make_task(cfg)
        self.rng = random.Random(cfg.seed)  # prompts and group ids
        self.selector = GroupSelector(cfg.rollout, EpisodeCounters())  # which groups are trained; episode accounting
        self.summary = RunSummary(held_out_score=held_out_score(cfg, self.task))
        self.step = self.version = 0
        self.scheduler: RolloutScheduler | None = None  # once the actors run
        self.interrupted: str | None = None  # the signal that asked the job to stop early

    def request_stop(self, reason: str) -> None:
        """Finish the current step, then wind down as at the end (checkpoint if configured, no evaluation)."""
        print(f"stopping after the current step{' and saving a checkpoint' if self.cfg.checkpoint.final else ''}",
              file=sys.stderr, flush=True)
        self.interrupted = reason
        if self.scheduler is not None:
            self.scheduler.stop()

    async def run(self, resume: bool) -> None:
        cfg, wall_start = self.cfg, time.perf_counter()
        resumed = self.checkpoints().newest() if resume else None  # before the start-up it would otherwise waste
        model_path, self.summary.warm_start_accuracy = await asyncio.to_thread(warm_started_model, cfg, self.task)
        teacher_path, self.summary.teacher_warm_start_accuracy = await asyncio.to_thread(teacher_model, cfg, self.task)
        self.summary.teacher = teacher_path
        # From here the controller's tensor work is small (packing episodes): intra-op threads would only spin-wait
        # after each op (OpenMP), which tripled its CPU per step on the tiny job.
        torch.set_num_threads(1)
        self.actors = await start_actors(cfg, model_path, teacher_path)
        self.rollout = await make_rollout(cfg, self.task, self.actors)  # single-turn or multi-turn groups
        self.held_out = HeldOut(cfg, self.task, self.rollout, self.actors.tokenizer)
        self.scheduler = RolloutScheduler(self.actors.buffer, self.actors.trainer, self.actors.scorer,
                                          pad_id=self.actors.pad_id, group_size=cfg.rollout.group_size,
                                          max_groups_in_flight=cfg.rollout.concurrency,
                                          teacher_top_k=cfg.teacher.top_k, on_lost=self.lost)
        if resumed:
            await self.restore(*resumed)
        self.version = rank0(await self.actors.trainer.publish_weights.call())
        await self.actors.generators.update_weights.fanout(self.version)
        if cfg.eval.at_start and not self.interrupted:
            self.summary.accuracy_start = await self.evaluate("start")
        await self.train()
        if cfg.eval.at_end and not self.interrupted:
            self.summary.accuracy_end = await self.evaluate("end")
        await self.finish(wall_start)

    # --- rollouts fill the buffer while the trainer drains it -----------------------------------------------------
    async def train(self) -> None:
        """The asynchronous part of the job (apps/grpo/scheduler.py): groups are generated and scored into the replay
        buffer (`generate`) while the trainer trains on batches from it, each step logged (`after_step`)."""
        cfg = self.cfg
        self.logger = MetricLogger.from_config(cfg.metrics, total_steps=cfg.steps,
                                               jsonl_default=Path(cfg.run_dir) / "metrics.jsonl")
        self.kl_watch = ReverseKLWatch(cfg.teacher.kl_check_steps if cfg.teacher.model is not None else 0)
        start_step, loop_start, loop_cpu = self.step, time.perf_counter(), time.process_time()
        if self.interrupted:  # a signal during the start-up
            self.scheduler.stop()
        self.scheduler.published(self.version, steps_left=cfg.steps - self.step)
        try:
            await self.scheduler.run(generate=self.generate, steps=cfg.steps - self.step, on_step=self.after_step)
        finally:
            self.logger.close()
        self.summary.train_s, self.summary.steps_this_run = time.perf_counter() - loop_start, self.step - start_step
        self.summary.controller_cpu_s = time.process_time() - loop_cpu

    async def generate(self, count: int, version: int) -> EpisodeBatch | KeptEpisodes | None:
        """`count` prompts' groups, generated with policy `version` or newer, scored and given their advantages: the
        episodes of the groups to train for the scheduler to add to the buffer (None: none), or, single-turn, which
        of the completions the generator replicas keep to train (the buffer takes them from there)."""
        problems = self.task.sample_prompts(count, self.rng)
        played = await self.rollout.play_groups(problems, sampling_params(self.cfg, self.task), version)
        trained = []
        for group in filter(None, map(self.selector.trainable, played)):  # failed, too small or no signal: dropped
            rewards = torch.tensor(group.rewards)
            advantages, _ = group_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long),
                                             normalize_std=self.cfg.rollout.normalize_advantages)
            group_id = self.rng.getrandbits(62 - EPISODE_BITS)  # its episode ids travel as int64
            trained.append((group, group_id, advantages.tolist()))
        episodes = buffer_episodes(played, trained)
        if episodes is not None:
            self.selector.counters.generated += len(episodes)  # counted as sent: a job stopped before counts none
        return episodes

    def lost(self, added: Added) -> None:
        """Trained episodes the buffer could not take from the generator replica that kept them (it died after
        generating them): failed generations, as if it had died while generating them."""
        counters = self.selector.counters
        counters.generated -= added.lost_episodes
        counters.generation_failures += added.lost_groups
        record_metric("rollout/generation_failures", added.lost_groups, "sum")

    async def after_step(self, step: TrainedStep) -> None:
        """A training step is done (its version being published): count it, log it, evaluate and checkpoint when due."""
        cfg = self.cfg
        self.step, self.version = self.step + 1, step.result.version
        self.selector.new_step()
        self.selector.counters.trained += step.batch.episodes
        if cfg.canary.every and self.step % cfg.canary.every == 0:
            step.result.metrics["canary/logprob_diff"] = await self.check_weight_sync()
        record = self.logger.log(self.step, await get_provisioner().collect_metrics(), step_record(
            step.batch, step.result, step.waited_s, time.perf_counter() - step.started,
            time.process_time() - step.cpu_started))
        self.summary.step_logged(record, memory=get_provisioner().memory_rss)
        self.kl_watch.step(self.step, record.get("reverse_kl"))
        if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.steps:
            await self.evaluate(f"step {self.step}")
        if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
            await self.save_checkpoint()

    async def check_weight_sync(self) -> float:
        """The trainer and every generator replica score the first held-out prompt and its answer
        (actors/weight_canary.py)."""
        problem, tokenizer = self.task.held_out()[0], self.actors.tokenizer
        await self.actors.trainer.wait_published.call()
        return await check_weight_sync(self.actors.trainer, self.actors.generators, tokenizer.encode(problem.prompt),
                                       tokenizer.encode(problem.answer), self.cfg.canary.max_logprob_diff)

    # --- evaluation, checkpoints, summary ---------------------------------------------------------------
    async def evaluate(self, label: str) -> float:
        await self.actors.trainer.wait_published.call()  # the trainer publishes each version in the background
        await self.actors.generators.update_weights.fanout(self.version)  # the newest policy, not a lagging one
        return self.summary.evaluated(label, self.version, await self.held_out.score(label))

    async def save_checkpoint(self) -> Path:
        state = {"step": self.step, "version": self.version, "rng": self.rng.getstate(),
                 "counters": asdict(self.selector.counters), "buffer": await self.actors.buffer.state_dict.call_one()}
        return await self.checkpoints().save(self.step, self.actors.trainer, state)

    async def restore(self, path: Path, state: dict[str, Any]) -> None:
        await self.checkpoints().load_trainer(path, self.actors.trainer)
        await self.actors.buffer.load_state_dict.call_one(state["buffer"])
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        self.selector.counters = EpisodeCounters(**state["counters"])
        print(f"resumed from {path}: step {self.step}, policy version {state['version']}", flush=True)

    def checkpoints(self) -> JobCheckpoints:
        return JobCheckpoints(self.cfg.checkpoint.folder, self.cfg.checkpoint.keep)

    async def finish(self, wall_start: float) -> None:
        """The final checkpoint and export, then the summary."""
        s, run_dir = self.summary, Path(self.cfg.run_dir)
        if self.cfg.checkpoint.final and s.steps_this_run:
            saved = self.checkpoints().path(self.step)
            s.checkpoint = str(saved if saved.exists() else await self.save_checkpoint())
        if not self.interrupted:
            s.hf_model = str(run_dir / "hf_model")
            await self.actors.trainer.export_hf.call(s.hf_model)
        s.finish(run_dir, steps=self.step, policy_version=self.version, interrupted=self.interrupted,
                 counters=self.selector.counters, buffer_stats=await self.actors.buffer.stats.call_one(),
                 reward_failures=self.rollout.reward_failures, wall_s=time.perf_counter() - wall_start)

def run(cfg: GRPOConfig, resume: bool) -> int:
    """Run the job under forge.lifecycle: a first SIGINT/SIGTERM finishes the step and checkpoints."""
    job = GRPOJob(cfg)
    return run_job(lambda: job.run(resume), on_stop=job.request_stop,
                   stop_grace_s=cfg.checkpoint.stop_grace_s)
