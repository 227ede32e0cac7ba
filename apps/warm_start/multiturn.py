"""The supervised warm start of a multi-turn task: teacher-forced on correct episodes, model turns only.

A correct episode is the task's `transcript(problem)`: (text, written by the model) segments. Each segment is
encoded on its own and the ids are concatenated, exactly as the rollout appends observations by id, so the warm
start trains on the token sequences the model will see. Labels cover the model's segments (and the EOS after the
last one); the accuracy that stops it is the multi-turn greedy accuracy, played against the task's environments.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

from rl.demonstrations import transcript_example
from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from rl.environments.trajectory import Trajectory
from rl.tasks.protocol import MultiTurnTask, TaskProblem
from rl.types import SamplingParams
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.supervised import log_now, padded_batch, train_until_accurate


def warm_start_multiturn(model_dir: str | Path, out_dir: str | Path, *, task: MultiTurnTask, task_name: str,
                         train_problems: Callable[[int], Sequence[TaskProblem]], eval_problems: Sequence[TaskProblem], limits: EnvironmentConfig,
                         config: WarmStartConfig, seed: int, max_tokens: int,
                         log: Callable[[str], None] = log_now) -> tuple[Path, float]:
    """Train on `task.transcript(p)` for `train_problems(n)` until greedy multi-turn accuracy on `eval_problems`
    reaches the target; returns the saved checkpoint directory and the accuracy reached.

    An evaluation episode whose environment failed is left out of the accuracy (not scored 0), counted and reported.
    A warm start that cannot produce any correct episode fails naming `task_name`: every evaluation episode failed in
    its environment. (A greedy accuracy of 0 is not that: sampled episodes can still be right, and GRPO learns from
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
        played = asyncio.run(greedy_episodes(model, tokenizer, task, eval_problems, limits, max_tokens))
        failed = [t for t in played if t.failed]
        failures.append(len(failed))
        if len(failed) == len(played):
            raise RuntimeError(f"warm start of task {task_name!r}: all {len(played)} evaluation episodes failed in "
                               f"their environment (first: {failed[0].error}); it cannot produce a correct episode")
        if failed:
            log(f"warm start: {len(failed)} of {len(played)} evaluation episodes left out of the accuracy: their "
                f"environment failed (first: {failed[0].error})")
        return sum(t.reward for t in played if not t.failed) / (len(played) - len(failed))

    path, reached = train_until_accurate(
        model_dir, out_dir, cache_key={"eval": [tuple(map(str, p)) for p in eval_problems[:20]], "multiturn": True},
        batch=batch, accuracy=accuracy, config=config, seed=seed, log=log,
        what=f"greedy multi-turn accuracy on {len(eval_problems)} problems")
    if failures:
        log(f"warm start: environment failures {sum(failures)} of {len(failures) * len(eval_problems)} evaluation "
            "episodes (left out of the accuracy)")
    return path, reached


def transcript_ids(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """The episode's ids and which ones the model writes (rl.demonstrations' `transcript_example`, as lists)."""
    example = transcript_example(tokenizer, segments)
    return list(example.ids), list(example.learned)


async def greedy_episodes(model, tokenizer, task: MultiTurnTask, problems: Sequence[TaskProblem], limits: EnvironmentConfig,
                          max_tokens: int) -> list[Trajectory]:
    """Greedy episodes of `problems`, played in one batch per turn with the training model itself."""
    from actors.engines.hf import HFEngine

    engine = HFEngine.from_model(model, tokenizer)

    async def generate(prompts: list[list[int]], params: SamplingParams):
        return [out[0] for out in engine.generate(prompts, params)]

    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(task.stop_token_ids))
    return await run_episodes(generate, [task.environment() for _ in problems], problems, params, limits,
                              encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                              end_token_ids=[tokenizer.eos_token_id])
