"""Reward scoring for GRPO: the task's own reward inline, a user's reward on threads under a timeout.

A reward that raises, returns NaN or hangs past its timeout scores 0, is counted (`reward/failures`), and each
kind of failure is printed once with its traceback; the run goes on.

A hung user function costs one thread for as long as it hangs, never the scorer: a call that times out is
abandoned (its thread runs on, as a daemon) and the next call gets a fresh thread. Abandoned threads are counted
(`reward/abandoned_threads`) and bounded: past `max_abandoned` still hung, scoring stops the job with an error
naming the reward, since a process filling up with stuck threads would otherwise fail later and less clearly.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import traceback
from typing import Callable

from forge.metrics import record_metric
from rl.rollout import FatalRolloutError


class RewardHangError(FatalRolloutError):
    """Too many calls of the user's reward function are hung at once: the job's end (the rollout re-raises it)."""


class RewardScorer:
    def __init__(self, fn: Callable[[str, str], float], timeout_s: float | None, *, threads: int = 32,
                 max_abandoned: int = 256, name: str = "task.reward") -> None:
        """`timeout_s=None` scores inline (the task's built-in reward: it cannot hang, and a thread hand-off per
        completion cost the controller more CPU than the reward itself). Otherwise at most `threads` calls run
        at once, each on its own thread."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (or None to score inline)")
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.max_abandoned = max_abandoned
        self.failures = 0
        self.abandoned = 0  # timed-out calls whose threads are still running
        self._lock = threading.Lock()  # `abandoned` is decremented by the abandoned threads themselves
        self._slots = asyncio.Semaphore(threads) if timeout_s is not None else None
        self._reported: set[str] = set()

    async def score(self, texts: list[str], answer: str) -> list[float]:
        """One reward per completion of the same prompt."""
        if self._slots is None:
            return [self._inline(text, answer) for text in texts]
        return list(await asyncio.gather(*(self._on_thread(text, answer) for text in texts)))

    def _inline(self, text: str, answer: str) -> float:
        try:
            return _valid_reward(self.fn(text, answer))
        except Exception as e:
            return self._failed(e)

    async def _on_thread(self, text: str, answer: str) -> float:
        async with self._slots:
            if self.abandoned >= self.max_abandoned:
                raise RewardHangError(
                    f"{self.name}: {self.abandoned} calls are still hung after their {self.timeout_s}s timeout "
                    f"(the limit is {self.max_abandoned}); the reward function blocks forever on some inputs")
            call = _ThreadCall(self.fn, text, answer, self)
            try:
                return _valid_reward(await asyncio.wait_for(asyncio.shield(call.result), self.timeout_s))
            except asyncio.TimeoutError as e:
                call.abandon()
                return self._failed(e)
            except Exception as e:
                return self._failed(e)

    def _failed(self, error: Exception) -> float:
        self.failures += 1
        record_metric("reward/failures", 1, "sum")
        kind = type(error).__name__
        if kind not in self._reported:  # each kind of failure is shown once, with its traceback
            self._reported.add(kind)
            detail = (f"timed out after {self.timeout_s}s" if isinstance(error, asyncio.TimeoutError)
                      else "".join(traceback.format_exception(error)))
            print(f"reward function failed ({kind}); scoring as 0 and continuing:\n{detail}", file=sys.stderr)
        return 0.0


class _ThreadCall:
    """One reward call on a daemon thread of its own, answering into the event loop's future `result`."""

    def __init__(self, fn: Callable[[str, str], float], text: str, answer: str, scorer: RewardScorer) -> None:
        self.scorer = scorer
        self.loop = asyncio.get_running_loop()
        self.result: asyncio.Future = self.loop.create_future()
        self.finished = self.abandoned = False
        threading.Thread(target=self._run, args=(fn, text, answer), daemon=True, name="reward").start()

    def _run(self, fn: Callable[[str, str], float], text: str, answer: str) -> None:
        try:
            outcome = (fn(text, answer), None)
        except Exception as e:
            outcome = (None, e)
        with self.scorer._lock:
            self.finished = True
            if self.abandoned:
                self.scorer.abandoned -= 1
                return
        try:
            self.loop.call_soon_threadsafe(self._answer, *outcome)
        except RuntimeError:  # the event loop has closed: nobody is waiting
            pass

    def _answer(self, value: object, error: Exception | None) -> None:
        if not self.result.done():
            self.result.set_exception(error) if error is not None else self.result.set_result(value)

    def abandon(self) -> None:
        with self.scorer._lock:
            if self.finished:
                return
            self.abandoned = True
            self.scorer.abandoned += 1
            still_hung = self.scorer.abandoned
        self.result.cancel()  # whatever the thread ends with, nobody reads it
        record_metric("reward/abandoned_threads", still_hung, "max")


def _valid_reward(value: object) -> float:
    value = float(value)
    if math.isnan(value):
        raise ValueError("reward returned NaN")
    return value
