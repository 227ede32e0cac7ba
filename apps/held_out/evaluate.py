"""One task's held-out prompts through a sampler: at most `concurrency` prompts in flight, a progress line now and
then, every sample scored or counted as failed with its error (scores.py says how failures are left out).

A sampler's `sample(problem, params)` gives `params.n` samples of one problem, each a text (scored here by the task's
reward), a `Scored` text (a multi-turn episode its environment scored) or the error that sample failed with.

`evaluate_greedy` is the held-out figure the training apps report (GRPO, SFT, the warm start, the REST client's
example): one greedy sample per problem, scored by these rules. Plain Python and asyncio, no torch: a client program
imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from apps.held_out.scores import ProblemResult, TaskScore, score_task
from rl.sampling import SamplingParams


@dataclass
class Sample:
    """One sample, as samples.jsonl holds it."""

    version: str
    task: str
    prompt_index: int
    prompt: str
    answer: str
    text: str | None
    reward: float | None
    error: str | None


@dataclass
class Scored:
    """A sample already scored where it was played: a multi-turn episode's text and its environment's reward."""

    text: str
    reward: float


class Reward:
    """The task's reward, or the user's (`task.reward`) on a thread under `task.reward_timeout_s`. A reward that
    raises, returns NaN or times out fails its sample (it is not the model's answer).

    A timed call runs on a daemon thread of its own, at most `threads` at once, its timeout counted from its start: a
    whole evaluation in flight (500 prompts) waits for a thread without timing out, and a call abandoned at its
    timeout runs on where it hangs, holding no shared pool's worker from the calls after it."""

    def __init__(self, fn: Callable[[str, str], float], timeout_s: float | None, threads: int = 32) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        self.slots = asyncio.Semaphore(threads)

    async def __call__(self, text: str, answer: str) -> float:
        if self.timeout_s is None:
            value = self.fn(text, answer)
        else:
            async with self.slots:
                value = await asyncio.wait_for(_on_own_thread(self.fn, text, answer), self.timeout_s)
        value = float(value)
        if math.isnan(value):
            raise ValueError("the reward returned NaN")
        return value


async def _on_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a new daemon thread; cancelling the wait abandons the call, which runs on (it cannot be
    stopped) and answers no one."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not answer.done():
            answer.set_exception(error) if error is not None else answer.set_result(value)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as e:
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop has closed: nobody is waiting
            pass

    threading.Thread(target=run, daemon=True, name="held-out reward").start()
    return await answer


class Progress:
    """`label: done/total prompts, rate, failed samples`, at most every `every_s` seconds (0: never)."""

    def __init__(self, label: str, total: int, every_s: float) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.done = self.failed = 0
        self.start = self.last = time.perf_counter()

    def add(self, result: ProblemResult) -> None:
        self.done += 1
        self.failed += len(result.errors)
        now = time.perf_counter()
        if self.every_s and now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            print(self.line(now), flush=True)

    def line(self, now: float) -> str:
        rate = self.done / max(now - self.start, 1e-9)
        return (f"{self.label}: {self.done}/{self.total} prompts ({rate:.1f}/s), {self.failed} samples failed")


async def evaluate_task(sampler: Any, problems: list, params: SamplingParams, reward: Reward, *, seed: int | None,
                        slots: asyncio.Semaphore, progress: Progress,
                        on_sample: Callable[[int, Any, str | None, float | None, str | None], None] | None = None,
                        fatal: tuple[type[BaseException], ...] = ()) -> list[ProblemResult]:
    """Each problem's result, in order; prompt i is sampled with seed `seed + i` when `seed` is set. A sampler's error
    of a `fatal` type is the evaluation's end (raised), not its problem's failed samples."""

    async def one(i: int, problem: Any) -> ProblemResult:
        async with slots:
            prompt_params = params if seed is None else dataclasses.replace(params, seed=seed + i)
            try:
                texts = await sampler.sample(problem, prompt_params)
            except fatal:
                raise
            except Exception as e:  # the request failed: all its samples did
                texts = [e] * params.n
            result = ProblemResult()
            for text in texts:
                value, error = None, None
                if isinstance(text, Exception):
                    error, text = describe(text), None
                elif isinstance(text, Scored):
                    value, text = text.reward, text.text
                else:
                    try:
                        value = await reward(text, problem.answer)
                    except Exception as e:
                        error = f"reward: {describe(e)}"
                if error is None:
                    result.rewards.append(value)
                else:
                    result.errors.append(error)
                if on_sample is not None:
                    on_sample(i, problem, text, value, error)
        progress.add(result)
        return result

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(problems))))


async def evaluate_greedy(sampler: Any, problems: list, reward: Reward, *, max_tokens: int,
                          stop_token_ids: Sequence[int] = (), label: str, concurrency: int | None = None,
                          fatal: tuple[type[BaseException], ...] = ()) -> TaskScore:
    """One greedy sample of each problem (n=1, temperature 0, stopped at `stop_token_ids`) through `evaluate_task`,
    scored by `score_task`: `mean_reward` is the mean reward over the problems whose sample did not fail (the accuracy
    where rewards are 0 or 1; `pass_at[1]` counts a reward of 1 as correct), `failed_samples` and `failures` count
    those that failed, left out. `concurrency`: problems in flight (None: all at once, so that a BatchingSampler plays
    the whole evaluation as one call)."""
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop_token_ids))
    slots = asyncio.Semaphore(concurrency or max(1, len(problems)))
    results = await evaluate_task(sampler, problems, params, reward, seed=None, slots=slots,
                                  progress=Progress(label, len(problems), 0), fatal=fatal)
    return score_task(results, 1, [1], 1.0)


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, without an endpoint's remote traceback: failures are grouped by it."""
    message = str(error).split("\n--- remote traceback", 1)[0].strip().splitlines()
    return (f"{type(error).__name__}: {message[0]}" if message else type(error).__name__)[:300]
