"""Where held-out samples come from in forge: its generator service, through the rollout every app plays with
(rl.rollout: a prompt's completions, or a multi-turn task's episodes). apps.eval adds an OpenAI-compatible server over
HTTP (apps/eval/samplers.py); the warm start, its in-process model (apps/warm_start/); the REST client's example, the
server's sampling (apps/examples/client_rl_loop.py).

Each sampler has `sample(problem, params) -> list[str | Scored | Exception]`: `params.n` samples of one problem, each a
text, an episode its environment scored, or the error that sample failed with. A call that raises failed all n samples.
One that plays many problems in one call (`sample_many(problems, params)`, one such list or error per problem) is
given `sample` by BatchingSampler. No torch here: a client program imports it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from apps.held_out.evaluate import Scored
from rl.sampling import SamplingParams

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
    which batches concurrent calls with the same parameters into one engine call; `sample_many` plays many problems in
    one rollout call (one per healthy replica)."""

    def __init__(self, rollout: Rollout, tokenizer: Any = None) -> None:
        self.rollout, self.tokenizer = rollout, tokenizer

    async def sample(self, problem: TaskProblem, params: SamplingParams) -> list[str | Scored | Exception]:
        (samples,) = await self.sample_many([problem], params)
        if isinstance(samples, Exception):
            raise samples
        return samples

    async def sample_many(self, problems: list[TaskProblem],
                          params: SamplingParams) -> list[list[str | Scored | Exception] | Exception]:
        groups = await self.rollout.play_groups(problems, params)
        return [group if isinstance(group, Exception) else self._samples(group) for group in groups]

    def _samples(self, group: Any) -> list[str | Scored | Exception]:
        if not isinstance(group.samples, list):  # a single-turn group's CompletionBatch
            return list(group.samples.texts)
        return episode_samples(group.samples, self.tokenizer)


def episode_samples(trajectories: list, tokenizer: Any) -> list[Scored | Exception]:
    """Multi-turn episodes (rl.environments' Trajectory) as samples: each scored by its environment, its text the
    episode after the first prompt decoded with `tokenizer`, or EnvironmentFailed with what it ended with."""
    return [EnvironmentFailed(t.error or "the environment failed") if t.failed else
            Scored(tokenizer.decode(t.completion_ids), t.reward) for t in trajectories]


class BatchingSampler:
    """`sample` over `sampler.sample_many`: the calls made in one turn of the event loop with equal params go as one
    `sample_many` call, each answered with its problem's entry (an error there, or one the whole call raised, fails
    that problem's samples). With every problem in flight at once (evaluate_greedy's default), an evaluation is one
    call: a rollout's one batch per generator replica, an in-process model's one batch, a client's one request."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self._gathering: list[tuple[SamplingParams, list[tuple[Any, asyncio.Future]]]] = []
        self._playing: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references

    async def sample(self, problem: Any, params: SamplingParams) -> list[str | Scored | Exception]:
        loop = asyncio.get_running_loop()
        calls = next((calls for p, calls in self._gathering if p == params), None)
        if calls is None:  # the first of this turn's calls: the rest join it before it starts
            calls = []
            self._gathering.append((params, calls))
            loop.call_soon(self._start, params, calls)
        answer = loop.create_future()
        calls.append((problem, answer))
        samples = await answer
        if isinstance(samples, Exception):
            raise samples
        return samples

    def _start(self, params: SamplingParams, calls: list) -> None:
        self._gathering = [entry for entry in self._gathering if entry[1] is not calls]
        task = asyncio.ensure_future(self._play(params, calls))
        self._playing.add(task)
        task.add_done_callback(self._playing.discard)

    async def _play(self, params: SamplingParams, calls: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            answers = list(await self.sampler.sample_many([problem for problem, _ in calls], params))
            if len(answers) != len(calls):
                raise RuntimeError(f"sample_many answered {len(answers)} problems of {len(calls)}")
        except Exception as e:  # the call failed: every problem in it did
            answers = [e] * len(calls)
        except BaseException:  # cancelled: so are its callers
            for _, answer in calls:
                answer.cancel()
            raise
        for (_, answer), samples in zip(calls, answers):
            if not answer.done():  # its caller may have been cancelled
                answer.set_result(samples)
