"""Supervised fine-tuning through apps.grpo's trainer actor.

    python -m apps.sft --config configs/sft_tiny.yaml [key=value ...] [--resume]

    examples (task answers | JSONL / dataset rows, chat or prompt-completion) -> masked, padded (or packed) TrainBatch
        -> TrainerActor (TorchTitan, FSDP2 over resources.trainer_procs ranks; loss losses/nll.py) -> next version

Each step trains `batch_size` examples; the trainer publishes each version, which a generator service follows to
sample the held-out prompts (greedy accuracy, scored by the shared held-out evaluator, apps/held_out/). Checkpoints
(trainer and data position) are the apps' shared ones (apps/run_checkpoints.py); the run ends with `run_dir/hf_model` and `summary.json`.
Runs under forge.lifecycle.run_job: a first SIGINT/SIGTERM finishes the step and checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from actors.model_files import read_hf_config
from apps.held_out.evaluate import Reward, evaluate_greedy
from apps.held_out.samplers import RolloutSampler
from apps.run_checkpoints import JobCheckpoints
from apps.sft.config import SFTConfig
from apps.sft.data import Example, train_batch
from apps.sft.sources import SFTData
from apps.sft.trainer import SFTTrainerActor
from forge.actor import rank0
from forge.lifecycle import run_job
from forge.metrics import MetricLogger
from rl.environments.player import start_player
from rl.rollout import MultiTurn, SingleTurn
from rl.types import TrainBatch
from forge.weights.startup import start_weight_store

WEIGHTS = "sft"  # the weight store namespace the trainer publishes to and the held-out generator follows
EVAL_CONCURRENCY = 64  # held-out prompts in flight (the generator batches them)


class SFTJob:
    def __init__(self, cfg: SFTConfig, tokenizer: Any, data: SFTData) -> None:
        self.cfg, self.tokenizer, self.data = cfg, tokenizer, data
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        positions = read_hf_config(cfg.trainer.model_path).get("max_position_embeddings")
        if self.data.dropped:
            print(f"data: {self.data.dropped} examples longer than {cfg.data.max_length or positions} tokens left "
                  "out (data.max_length)", flush=True)
        # packing: rows of up to this many tokens, several examples each (null max_length: the model's context)
        self.pack_to = (cfg.packing.max_length or positions) if cfg.packing.enabled else None
        self.step = self.version = 0
        self.summary: dict[str, Any] = {}
        # Each step's line and record; an evaluation's results are a record of their own, at the step it followed.
        self.logger = MetricLogger.from_config(cfg.metrics, total_steps=cfg.steps,
                                               jsonl_default=Path(cfg.run_dir) / "metrics.jsonl")
        self.interrupted: str | None = None

    def request_stop(self, reason: str) -> None:
        print("stopping after the current step", file=sys.stderr, flush=True)
        self.interrupted = reason

    async def run(self, resume: bool) -> None:
        cfg, started = self.cfg, time.perf_counter()
        resumed = self.checkpoints().newest() if resume else None  # before the start-up it would otherwise waste
        await self.start_actors()
        if resumed:
            await self.restore(*resumed)
        self.version = rank0(await self.trainer.publish_weights.call())  # what the held-out generator samples
        if cfg.eval.at_start and not self.interrupted:
            self.summary["start"] = await self.evaluate("start")
        await self.train()
        if cfg.eval.at_end and not self.interrupted:
            self.summary["end"] = await self.evaluate("end")
        await self.finish(time.perf_counter() - started)

    async def start_actors(self) -> None:
        cfg, r = self.cfg, self.cfg.resources
        await start_weight_store()
        spawns = [SFTTrainerActor.options(procs=r.trainer_procs, with_gpus=r.with_gpus, mesh_name="trainer")
                  .as_actor(cfg.trainer, weight_namespace=WEIGHTS)]
        if cfg.measures_accuracy:
            from actors.generator import Generator

            spawns.append(Generator.options(num_replicas=1, with_gpus=r.with_gpus, mesh_name="generator").as_service(
                replace(cfg.generator, model=cfg.trainer.model_path, weight_namespace=WEIGHTS)))
        print(f"starting actors: trainer x{r.trainer_procs}{', generator' if cfg.measures_accuracy else ''}",
              flush=True)
        self.trainer, *generators = await asyncio.gather(*spawns)
        self.generators = generators[0] if generators else None
        if self.generators is not None:
            self.sampler = await self.held_out_sampler()

    async def held_out_sampler(self) -> RolloutSampler:
        """The held-out prompts' sampler: a multi-turn task's are episodes against its environments (on threads here,
        or on a host process of their own with `environment.isolated`), as apps.eval plays them (apps/held_out/)."""
        if not self.cfg.is_multi_turn_task:
            return RolloutSampler(SingleTurn(self.generators))
        player = await start_player(self.data.task, self.tokenizer, self.cfg.environment, self.generators)
        return RolloutSampler(MultiTurn(player), self.tokenizer)

    # --- training -------------------------------------------------------------------------------------------
    async def train(self) -> None:
        cfg = self.cfg
        first, started = self.step, time.perf_counter()
        while self.step < cfg.steps and not self.interrupted:
            step_start = time.perf_counter()
            examples = self.data.train.take(cfg.batch_size)
            batch = self.batch(examples, cfg.trainer.minibatches)
            result = rank0(await self.trainer.train_step.call(batch))
            self.step, self.version = self.step + 1, result.version
            self.logger.log(self.step, [], step_metrics(examples, batch, result.metrics,
                                                        time.perf_counter() - step_start))
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.steps:
                if reached(await self.evaluate(f"step {self.step}"), cfg.eval.stop_at_accuracy):
                    print(f"step {self.step}: held-out accuracy reached eval.stop_at_accuracy="
                          f"{cfg.eval.stop_at_accuracy}; training stops", flush=True)
                    self.summary["stopped_at_accuracy"] = self.step
                    break
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                await self.save_checkpoint()
        self.summary.update(steps_this_run=self.step - first, train_s=round(time.perf_counter() - started, 1))

    def batch(self, examples: list[Example], minibatches: int = 1) -> TrainBatch:
        """The trainer's batch: a row per example, or packed (`packing`), rows shared evenly by the ranks."""
        return train_batch(examples, self.pad_id, pack_to=self.pack_to, minibatches=minibatches,
                           ranks=self.cfg.resources.trainer_procs)

    # --- evaluation -----------------------------------------------------------------------------------------
    async def evaluate(self, label: str) -> dict[str, float]:
        """Held-out loss, and for a task source greedy held-out accuracy (the shared evaluator, apps/held_out/)."""
        results: dict[str, float] = {}
        held_out = self.data.held_out[: len(self.data.held_out) // self.cfg.resources.trainer_procs
                                      * self.cfg.resources.trainer_procs]  # an equal share per rank
        if held_out:
            batch = self.batch(held_out)
            results["eval/loss"] = rank0(await self.trainer.held_out_loss.call(batch))
        if self.generators is not None:
            results["eval/accuracy"] = await self.accuracy(label)
        if results:
            self.logger.log(self.step, [], results)
        return results

    async def accuracy(self, label: str) -> float:
        await self.trainer.wait_published.call()
        await self.generators.update_weights.fanout(self.version)
        task = self.data.task
        score = await evaluate_greedy(self.sampler, self.data.problems, Reward(task.reward, None),
                                      max_tokens=self.cfg.eval.max_tokens, stop_token_ids=task.stop_token_ids,
                                      label=f"eval {label}", concurrency=EVAL_CONCURRENCY)
        if score.failed_samples:
            print(f"eval {label}: {score.failed_samples} samples failed, left out: {score.failures}", file=sys.stderr,
                  flush=True)
        return score.pass_at[1]

    # --- checkpoints and the end ----------------------------------------------------------------------------
    def checkpoints(self) -> JobCheckpoints:
        return JobCheckpoints(self.cfg.checkpoint.folder, self.cfg.checkpoint.keep)

    async def save_checkpoint(self) -> Path:
        state = {"step": self.step, "version": self.version, "data": self.data.train.state_dict()}
        return await self.checkpoints().save(self.step, self.trainer, state)

    async def restore(self, path: Path, state: dict[str, Any]) -> None:
        await self.checkpoints().load_trainer(path, self.trainer)
        self.step, self.version = state["step"], state["version"]
        self.data.train.load_state_dict(state["data"])
        print(f"resumed from {path}: step {self.step}", flush=True)

    async def finish(self, wall_s: float) -> None:
        cfg, run_dir = self.cfg, Path(self.cfg.run_dir)
        if cfg.checkpoint.final and self.summary.get("steps_this_run"):
            saved = self.checkpoints().path(self.step)
            self.summary["checkpoint"] = str(saved if saved.exists() else await self.save_checkpoint())
        if not self.interrupted:
            self.summary["hf_model"] = str(run_dir / "hf_model")
            await self.trainer.export_hf.call(self.summary["hf_model"])
        self.logger.close()
        self.summary.update(steps=self.step, interrupted=self.interrupted, wall_s=round(wall_s, 1))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        print(f"summary: {json.dumps(self.summary)}", flush=True)


def reached(results: dict[str, float], stop_at_accuracy: float | None) -> bool:
    """Whether an evaluation's greedy accuracy reached `eval.stop_at_accuracy` (never, without one)."""
    return stop_at_accuracy is not None and results.get("eval/accuracy", 0.0) >= stop_at_accuracy


def step_metrics(examples: list[Example], batch: TrainBatch, trainer: dict[str, float],
                 step_s: float) -> dict[str, float]:
    """The step's line: the trainer's loss, grad norm and LR, the learned tokens per second of the whole step, and
    the share of the batch's tokens that is padding (what packing saves)."""
    learned = sum(sum(e.learned) for e in examples)
    return {"loss": trainer["loss"], "grad_norm": trainer["grad_norm"], "lr": trainer["lr"],
            "tokens_per_s": learned / step_s, "pad_fraction": 1 - sum(map(len, examples)) / batch.input_ids.numel(),
            "step_s": step_s}


def run(cfg: SFTConfig, tokenizer: Any, data: SFTData, resume: bool) -> int:
    """Run the job under forge.lifecycle: a first SIGINT/SIGTERM finishes the step and checkpoints. `tokenizer` and
    `data`: sources.load_job_data's, read before this module's imports (apps/sft/cli.py)."""
    job = SFTJob(cfg, tokenizer, data)
    return run_job(lambda: job.run(resume), on_stop=job.request_stop,
                   stop_grace_s=cfg.checkpoint.stop_grace_s)
