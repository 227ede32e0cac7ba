"""evaluate_task with a stand-in sampler (pure): at most `concurrency` prompts in flight, every failure (a request,
one sample, a reward that raises, returns NaN or hangs past its timeout) counted with its error, none scored; the
greedy figure the training apps report (evaluate_greedy), through a sampler that plays its problems as one call."""

import asyncio
import math
import time

import pytest

from apps.held_out.evaluate import Progress, Reward, evaluate_greedy, evaluate_task
from apps.held_out.samplers import BatchingSampler
from rl.tasks.arithmetic import Problem
from rl.types import SamplingParams


class Sampler:
    """Answers "<prompt's index>:<j>" for sample j; prompt 3's request fails, prompt 4's second sample fails."""

    def __init__(self) -> None:
        self.in_flight = self.most_in_flight = 0
        self.seeds: list[int | None] = []

    async def sample(self, problem: Problem, params: SamplingParams) -> list:
        prompt = problem.prompt
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.seeds.append(params.seed)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if prompt == "p3":
            raise ConnectionError("stand-in: the request failed\nsecond line")
        return [RuntimeError("stand-in: one sample") if (prompt, j) == ("p4", 1) else f"{prompt}:{j}"
                for j in range(params.n)]


def reward(text: str, answer: str) -> float:
    """p0's samples are right; p1's raise; p2's return NaN; p5's hang; the rest are wrong."""
    if text.startswith("p1"):
        raise ValueError("stand-in reward failure")
    if text.startswith("p2"):
        return float("nan")
    if text.startswith("p5"):
        time.sleep(0.5)
    return float(text.startswith(answer))


async def test_every_failure_is_counted_with_its_error_and_concurrency_is_bounded(capsys):
    problems = [Problem(f"p{i}", "p0") for i in range(8)]
    sampler, slots = Sampler(), asyncio.Semaphore(3)
    progress = Progress("eval test", len(problems), every_s=1e-9)
    results = await evaluate_task(sampler, problems, SamplingParams(n=2, max_tokens=1), Reward(reward, 0.1),
                                  seed=40, slots=slots, progress=progress)
    assert sampler.most_in_flight == 3  # `concurrency` prompts at once, no more
    assert sorted(sampler.seeds) == list(range(40, 48))  # prompt i: seed 40 + i
    assert [r.rewards for r in results] == [[1.0, 1.0], [], [], [], [0.0], [], [0.0, 0.0], [0.0, 0.0]]
    assert results[1].errors == ["reward: ValueError: stand-in reward failure"] * 2
    assert results[2].errors == ["reward: ValueError: the reward returned NaN"] * 2
    assert results[3].errors == ["ConnectionError: stand-in: the request failed"] * 2  # the request: both samples
    assert results[4].errors == ["RuntimeError: stand-in: one sample"]
    assert results[5].errors == ["reward: TimeoutError"] * 2
    assert progress.failed == 9
    assert "eval test: " in capsys.readouterr().out  # progress lines while it ran


class Batch:
    """A sampler of many problems in one call (`sample_many`): answers "<prompt>!" greedily; a problem whose prompt
    is "down" gets an error in its place, and `fail` fails the whole call."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.calls = fail, []

    async def sample_many(self, problems: list[Problem], params: SamplingParams) -> list:
        self.calls.append(([p.prompt for p in problems], params))
        if self.fail is not None:
            raise self.fail
        return [ConnectionError("stand-in: down") if p.prompt == "down" else [f"{p.prompt}!"] * params.n
                for p in problems]


async def test_a_greedy_evaluation_through_a_batching_sampler_is_one_call_and_failures_are_left_out():
    problems = [Problem("a", "a!"), Problem("b", "x"), Problem("down", "down!"), Problem("c", "c!")]
    batch = Batch()
    score = await evaluate_greedy(BatchingSampler(batch), problems, Reward(reward, None), max_tokens=3,
                                  stop_token_ids=[7], label="eval test")
    ((prompts, params),) = batch.calls  # every problem in flight at once: one call
    assert prompts == ["a", "b", "down", "c"]
    assert (params.n, params.temperature, params.max_tokens, params.stop_token_ids) == (1, 0.0, 3, [7])
    # 2 of the 3 that were scored are right; the failed one is left out and counted, never scored 0
    assert score.mean_reward == score.pass_at[1] == 2 / 3
    assert (score.prompts, score.failed_samples, score.failures) == (4, 1, {"ConnectionError: stand-in: down": 1})

    # Calls with other params, or bounded concurrency, go as more calls; a call that raises fails its problems.
    batch = Batch()
    await evaluate_greedy(BatchingSampler(batch), problems, Reward(reward, None), max_tokens=3, label="eval test",
                          concurrency=2)
    assert [prompts for prompts, _ in batch.calls] == [["a", "b"], ["down", "c"]]
    score = await evaluate_greedy(BatchingSampler(Batch(fail=RuntimeError("gone"))), problems, Reward(reward, None),
                                  max_tokens=3, label="eval test")
    assert score.failures == {"RuntimeError: gone": 4} and math.isnan(score.mean_reward)


async def test_a_fatal_error_ends_the_evaluation():
    class Fatal(RuntimeError):
        pass

    with pytest.raises(Fatal, match="no replica"):
        await evaluate_greedy(BatchingSampler(Batch(fail=Fatal("no replica"))), [Problem("a", "a!")],
                              Reward(reward, None), max_tokens=3, label="eval test", fatal=(Fatal,))


async def test_a_timed_reward_times_out_from_its_own_start_and_a_hung_one_holds_up_no_other():
    """500 calls in flight of a reward that takes 20 ms under a 0.5 s timeout: none times out waiting for a thread;
    then 40 calls that hang (past their timeout) leave the next calls their full time."""
    def slow(text: str, answer: str) -> float:
        time.sleep(2.0 if text == "hang" else 0.02)
        return 1.0

    reward = Reward(slow, 0.5)
    assert await asyncio.gather(*(reward("x", "") for _ in range(500))) == [1.0] * 500
    hung = await asyncio.gather(*(reward("hang", "") for _ in range(40)), return_exceptions=True)
    assert all(isinstance(e, asyncio.TimeoutError) for e in hung)
    started = time.monotonic()
    assert await asyncio.gather(*(reward("x", "") for _ in range(64))) == [1.0] * 64  # while those still hang
    assert time.monotonic() - started < 1.5
