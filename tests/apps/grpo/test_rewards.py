"""RewardScorer: failures score 0 and are counted; hung calls cost a thread each, never the scorer."""

import asyncio
import math
import threading
import time

import pytest

from apps.grpo.rewards import RewardHangError, RewardScorer
from forge.metrics import drain_local

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)


def exact(text: str, answer: str) -> float:
    return float(text == answer)


class HangsOn:
    """A reward that blocks on completions equal to `word` until released (the test releases it at the end)."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.release = threading.Event()
        self.entered = 0

    def __call__(self, text: str, answer: str) -> float:
        if text == self.word:
            self.entered += 1
            self.release.wait()
        return exact(text, answer)


async def test_inline_scoring_counts_raising_and_nan_rewards():
    def reward(text: str, answer: str) -> float:
        if text == "boom":
            raise RuntimeError("boom")
        return math.nan if text == "nan" else exact(text, answer)

    scorer = RewardScorer(reward, timeout_s=None)
    drain_local()
    assert await scorer.score(["46", "boom", "nan", "45"], "46") == [1.0, 0.0, 0.0, 0.0]
    assert scorer.failures == 2
    assert drain_local()["reward/failures"].value() == 2


async def test_100_hung_calls_leave_the_next_call_scored_promptly(capsys):
    hangs = HangsOn("hang")
    scorer = RewardScorer(hangs, timeout_s=0.2, threads=32)
    drain_local()
    try:
        # More hung calls than threads: a scorer whose threads stay tied up would time out on everything after.
        rewards = await scorer.score(["hang"] * 100, "46")
        assert rewards == [0.0] * 100 and hangs.entered == 100
        assert scorer.failures == 100 and scorer.abandoned == 100
        partials = drain_local()
        assert partials["reward/abandoned_threads"].value() == 100
        assert partials["reward/failures"].value() == 100
        assert capsys.readouterr().err.count("reward function failed (TimeoutError)") == 1  # shown once

        assert await scorer.score(["46", "12"], "46") == [1.0, 0.0]  # answered: a timed-out call would score 0.0
        assert scorer.failures == 100
    finally:
        hangs.release.set()
    deadline = time.monotonic() + 10
    while scorer.abandoned and time.monotonic() < deadline:  # released threads finish and are uncounted
        await asyncio.sleep(0.05)
    assert scorer.abandoned == 0


async def test_too_many_hung_calls_stop_the_job_naming_the_reward():
    hangs = HangsOn("hang")
    scorer = RewardScorer(hangs, timeout_s=0.1, threads=4, max_abandoned=5, name="task.reward=my.module:fn")
    try:
        assert await scorer.score(["hang"] * 5, "1") == [0.0] * 5
        with pytest.raises(RewardHangError, match=r"task.reward=my.module:fn: 5 calls are still hung after their "
                                                  r"0.1s timeout \(the limit is 5\)"):
            await scorer.score(["46"], "46")
    finally:
        hangs.release.set()


async def test_a_call_that_finishes_just_after_its_timeout_is_not_counted_as_hung():
    def slow(text: str, answer: str) -> float:
        time.sleep(2.0)
        return 1.0

    scorer = RewardScorer(slow, timeout_s=0.1)
    assert await scorer.score(["a", "b"], "a") == [0.0, 0.0]
    assert scorer.abandoned == 2
    deadline = time.monotonic() + 30
    while scorer.abandoned and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert scorer.abandoned == 0 and scorer.failures == 2


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"timeout_s=0: must be > 0"):
        RewardScorer(exact, timeout_s=0)
