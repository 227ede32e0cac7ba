"""evaluate_task with a stand-in sampler (pure): at most `concurrency` prompts in flight, every failure (a request,
one sample, a reward that raises, returns NaN or hangs past its timeout) counted with its error, none scored."""

import asyncio
import time

from apps.held_out.evaluate import Progress, Reward, evaluate_task
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
