"""Where held-out samples come from in forge: its generator service, through the rollout every app plays with
(rl.rollout: a prompt's completions, or a multi-turn task's episodes). apps.eval adds an OpenAI-compatible server over
HTTP (apps/eval/samplers.py).

Each sampler has `sample(problem, params) -> list[str | Scored | Exception]`: `params.n` samples of one problem, each a
text, an episode its environment scored, or the error that sample failed with. A call that raises failed all n samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apps.held_out.evaluate import Scored
from rl.types import CompletionBatch, SamplingParams

if TYPE_CHECKING:  # the rollout's module imports Monarch; an endpoint's evaluation starts no process of forge's
    from rl.rollout import Rollout
    from rl.tasks.protocol import TaskProblem


class EnvironmentFailed(RuntimeError):
    """An episode's environment failed (its reset or a step raised or timed out): not the model's answer."""


class RolloutSampler:
    """One problem's `params.n` samples through `rollout` (rl.rollout.SingleTurn without a scorer, or MultiTurn): a
    single-turn one's completions as texts (the evaluation scores them with its reward); a multi-turn one's episodes,
    scored by their environments, each as the text after the first prompt (the model's turns and the environment's
    replies) decoded with `tokenizer`, or EnvironmentFailed. The service routes each problem's call to a replica,
    which batches concurrent calls with the same parameters into one engine call."""

    def __init__(self, rollout: Rollout, tokenizer: Any = None) -> None:
        self.rollout, self.tokenizer = rollout, tokenizer

    async def sample(self, problem: TaskProblem, params: SamplingParams) -> list[str | Scored | Exception]:
        (group,) = await self.rollout.play_groups([problem], params)
        if isinstance(group, Exception):
            raise group
        if isinstance(group.samples, CompletionBatch):
            return list(group.samples.texts)
        return [EnvironmentFailed(t.error or "the environment failed") if t.failed else
                Scored(self.tokenizer.decode(t.completion_ids), t.reward) for t in group.samples]
