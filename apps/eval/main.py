"""The evaluation: each model version in turn, each task's held-out prompts, then the report.

With a model forge loads, a Generator service serves `model`; a step checkpoint's weights are read in this process
(weights.py), published to the weight store as the next version, and swapped into every replica before its tasks
run (one service for a whole run directory). A multi-turn task's samples are episodes played through that service
against the task's environments (rl.environments.player, as apps.grpo plays them), each scored by its environment.
With an endpoint no process is started. Runs under forge.lifecycle.run_job (signals, dead actors, clean-up) when it
starts actors.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from apps.eval.config import EvalJobConfig
from apps.eval.report import VersionResult, failures_text, plot, table, write_json
from apps.eval.samplers import EndpointSampler
from apps.eval.sources import ModelVersion
from apps.held_out.evaluate import Progress, Reward, Sample, evaluate_task
from apps.held_out.samplers import RolloutSampler
from apps.held_out.scores import score_task
from forge.config import load_callable, to_yaml
from forge.metrics import MetricLogger
from rl import tasks as rl_tasks
from rl.tasks.protocol import MultiTurnTask, Task
from rl.types import SamplingParams

WEIGHTS = "eval"  # the weight store namespace the checkpoints are published to


class Evaluation:
    def __init__(self, cfg: EvalJobConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tasks = [rl_tasks.make_task(t, seed=cfg.seed, model=cfg.model) for t in cfg.tasks]
        self.labels = cfg.task_labels()
        self.rewards = [Reward(load_callable(t.reward, field=f"tasks[{i}].reward"), t.reward_timeout_s) if t.reward
                        else Reward(task.reward, None) for i, (t, task) in enumerate(zip(cfg.tasks, self.tasks))]
        self.slots = asyncio.Semaphore(cfg.concurrency)
        self.samples = (self.out / "samples.jsonl").open("w") if cfg.save_samples else None
        if cfg.metrics.jsonl is None:  # this evaluation's own file (the JSONL backend appends)
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        self.metrics = MetricLogger.from_config(cfg.metrics, jsonl_default=self.out / "metrics.jsonl")
        self.results: list[VersionResult] = []

    async def evaluate(self, version: ModelVersion, samplers: list[Any]) -> VersionResult:
        """Every task on one model version, task i through `samplers[i]`."""
        s, start = self.cfg.sampling, time.perf_counter()
        result = VersionResult(version)
        for label, task, reward, sampler in zip(self.labels, self.tasks, self.rewards, samplers, strict=True):
            problems = task.held_out()[: self.cfg.num_prompts]
            params = SamplingParams(n=s.num_samples, max_tokens=s.max_tokens, temperature=s.temperature,
                                    top_p=s.top_p, stop_token_ids=list(task.stop_token_ids))
            progress = Progress(f"eval {version.label} {label}", len(problems), self.cfg.progress_every_s)
            played = await evaluate_task(sampler, problems, params, reward, seed=s.seed, slots=self.slots,
                                         progress=progress, on_sample=self._writer(version, label))
            result.tasks[label] = score_task(played, s.num_samples, s.ks, s.correct_at)
            print(progress.line(time.perf_counter()), flush=True)
        result.wall_s = time.perf_counter() - start
        self.results.append(result)
        self.metrics.log(len(self.results) - 1 if version.step is None else version.step, [], result.metrics())
        return result

    def _writer(self, version: ModelVersion, task: str):
        if self.samples is None:
            return None

        def write(i: int, problem: Any, text: str | None, reward: float | None, error: str | None) -> None:
            sample = Sample(version.label, task, i, problem.prompt, problem.answer, text, reward, error)
            self.samples.write(json.dumps(asdict(sample)) + "\n")

        return write

    def report(self) -> int:
        """Print the table and the failures, write results.json (and accuracy.png over a run's steps)."""
        s = self.cfg.sampling
        print(table(self.results, s.num_samples, s.ks), flush=True)
        failures = failures_text(self.results)
        if failures:
            print(failures, file=sys.stderr, flush=True)
        write_json(self.out / "results.json", self.results, json_config(self.cfg))
        written = [self.out / "results.json"]
        if self.cfg.run_dir is not None and len(self.results) > 1:
            plot(self.out / "accuracy.png", self.results, s.ks)
            written.append(self.out / "accuracy.png")
        if self.samples is not None:
            self.samples.close()
            written.append(self.out / "samples.jsonl")
        self.metrics.close()
        print(f"wrote {', '.join(map(str, written))}", flush=True)
        return 0


def json_config(cfg: EvalJobConfig) -> dict:
    """The config as results.json records it (credentials redacted, as printed)."""
    import yaml

    return yaml.safe_load(to_yaml(cfg))


async def evaluate_endpoint(cfg: EvalJobConfig) -> int:
    evaluation = Evaluation(cfg)
    sampler = EndpointSampler(cfg.endpoint)
    try:
        (version,) = cfg.versions()
        await evaluation.evaluate(version, [sampler] * len(cfg.tasks))
    finally:
        await sampler.close()
    return evaluation.report()


async def evaluate_with_generators(cfg: EvalJobConfig, versions: list[ModelVersion]) -> int:
    """One generator service for every version: a checkpoint's weights are published and swapped in."""
    import torch

    from actors.generator import Generator
    from apps.eval.weights import load_weights
    from forge.weights.store import WeightStore
    from forge.weights.startup import start_weight_store

    evaluation = Evaluation(cfg)
    await start_weight_store()
    served = versions[0].path if versions[0].kind == "hf" else cfg.model  # a lone HF export serves itself
    generators = await Generator.options(num_replicas=cfg.replicas, mesh_name="generator").as_service(
        replace(cfg.generator, model=served, weight_namespace=WEIGHTS))
    store, samplers = WeightStore(WEIGHTS), await task_samplers(cfg, evaluation.tasks, generators)
    for number, version in enumerate(versions, start=1):
        if version.kind == "checkpoint":
            weights = await asyncio.to_thread(load_weights, version.path, cfg.model)
            await store.publish(weights, number, dtype=getattr(torch, cfg.generator.dtype))
            await generators.update_weights.fanout(number)
            await store.delete_older_than(number)  # one version in shared memory at a time
        await evaluation.evaluate(version, samplers)
    return evaluation.report()


async def task_samplers(cfg: EvalJobConfig, tasks: list[Task], generators: Any) -> list[RolloutSampler]:
    """Each task's sampler on the generator service, through the rollout (rl.rollout): a single-turn task's prompts as
    they are; a multi-turn task's episodes, its environments on threads here or, with `environment.isolated`, on a host
    process of their own."""
    from rl.environments.player import start_player
    from rl.rollout import MultiTurn, SingleTurn

    tokenizer = None
    samplers: list[RolloutSampler] = []
    for i, (task_cfg, task) in enumerate(zip(cfg.tasks, tasks)):
        if not isinstance(task, MultiTurnTask):
            samplers.append(RolloutSampler(SingleTurn(generators)))
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        player = await start_player(task, tokenizer, cfg.environment, generators, task_cfg.chat_template_kwargs,
                                    mesh_name=f"environments-{i}")
        samplers.append(RolloutSampler(MultiTurn(player), tokenizer))
    return samplers


def run(cfg: EvalJobConfig) -> int:
    if cfg.endpoint is not None:  # no process of forge's: no lifecycle to run
        return asyncio.run(evaluate_endpoint(cfg))
    from apps.eval.weights import check_fits
    from forge.lifecycle import run_job

    versions = cfg.versions()
    try:
        for version in versions:
            if version.kind == "checkpoint":
                check_fits(version.path, cfg.model)  # a checkpoint of another model, refused before any process
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return run_job(lambda: evaluate_with_generators(cfg, versions))
