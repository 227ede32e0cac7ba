"""The supervised warm start of a multi-turn task: teacher-forced on correct episodes, model turns only.

A correct episode is the task's `transcript(problem)`: (text, written by the model) segments. Each segment is
encoded on its own and the ids are concatenated, exactly as the rollout appends observations by id, so the warm
start trains on the token sequences the model will see. Labels cover the model's segments (and the EOS after the
last one); the accuracy that stops it is the multi-turn greedy accuracy, played against the task's environments and
scored by the held-out evaluator the apps share (apps/held_out/).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

from rl.demonstrations import transcript_example
from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from rl.tasks.protocol import MultiTurnTask, TaskProblem
from rl.types import SamplingParams
from apps.held_out.evaluate import Reward, evaluate_greedy
from apps.held_out.samplers import BatchingSampler, episode_samples
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.supervised import checked_accuracy, log_now, padded_batch, train_until_accurate


def warm_start_multiturn(model_dir: str | Path, out_dir: str | Path, *, task: MultiTurnTask, task_name: str,
                         train_problems: Callable[[int], Sequence[TaskProblem]], eval_problems: Sequence[TaskProblem], limits: EnvironmentConfig,
                         config: WarmStartConfig, seed: int, max_tokens: int,
                         log: Callable[[str], None] = log_now) -> tuple[Path, float]:
    """Train on `task.transcript(p)` for `train_problems(n)` until greedy multi-turn accuracy on `eval_problems`
    reaches the target; returns the saved checkpoint directory and the accuracy reached.

    The accuracy is the shared held-out evaluator's (apps/held_out/): an evaluation episode whose environment failed is
    left out (not scored 0), counted and reported. A warm start that cannot produce any correct episode fails naming
    `task_name`: every evaluation episode failed. (A greedy accuracy of 0 is not that: sampled episodes can still be right, and GRPO learns from
    them.)"""
    failures = []

    def batch(tokenizer, n: int):
        rows, labels = [], []
        for problem in train_problems(n):
            ids, learned = transcript_ids(tokenizer, task.transcript(problem))
            rows.append(ids)
            labels.append([t if m else -100 for t, m in zip(ids, learned)])
        return padded_batch(rows, labels, tokenizer.pad_token_id)

    def accuracy(model, tokenizer) -> float:
        sampler = BatchingSampler(EpisodeSampler(model, tokenizer, task, limits))
        score = asyncio.run(evaluate_greedy(sampler, list(eval_problems), Reward(scored_by_its_environment, None),
                                            max_tokens=max_tokens, stop_token_ids=task.stop_token_ids,
                                            label="warm start"))
        failures.append(score.failed_samples)
        return checked_accuracy(score, "episodes", log, task_name)

    path, reached = train_until_accurate(
        model_dir, out_dir, cache_key={"eval": [tuple(map(str, p)) for p in eval_problems[:20]], "multiturn": True},
        batch=batch, accuracy=accuracy, config=config, seed=seed, log=log,
        what=f"greedy multi-turn accuracy on {len(eval_problems)} problems")
    if any(failures):
        log(f"warm start: {sum(failures)} of {len(failures) * len(eval_problems)} evaluation episodes failed over its "
            "checks (left out of the accuracy)")
    return path, reached


def transcript_ids(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """The episode's ids and which ones the model writes (rl.demonstrations' `transcript_example`, as lists)."""
    example = transcript_example(tokenizer, segments)
    return list(example.ids), list(example.learned)


class EpisodeSampler:
    """The held-out evaluator's sampler (apps/held_out/) over greedy episodes of the training model in this process:
    `sample_many` plays its problems against the task's environments in one batch per turn (actors.engines.hf.HFEngine
    over the model itself), one episode each (n=1)."""

    def __init__(self, model, tokenizer, task: MultiTurnTask, limits: EnvironmentConfig) -> None:
        from actors.engines.hf import HFEngine

        self.engine = HFEngine.from_model(model, tokenizer)
        self.tokenizer, self.task, self.limits = tokenizer, task, limits

    async def sample_many(self, problems: Sequence[TaskProblem], params: SamplingParams) -> list[list]:
        if params.n != 1:
            raise ValueError(f"EpisodeSampler plays one episode a problem: n={params.n}")

        async def generate(prompts: list[list[int]], turn_params: SamplingParams):
            return [out[0] for out in self.engine.generate(prompts, turn_params)]

        played = await run_episodes(generate, [self.task.environment() for _ in problems], problems, params,
                                    self.limits, encode=lambda t: self.tokenizer.encode(t, add_special_tokens=False),
                                    end_token_ids=[self.tokenizer.eos_token_id])
        return [episode_samples([t], self.tokenizer) for t in played]


def scored_by_its_environment(text: str, answer: str) -> float:
    """The evaluation's reward, never called: every sample is an episode its environment scored (or failed)."""
    raise TypeError("a multi-turn episode is scored by its environment, not by a reward")
