"""An episode's environment on a thread of its own: its code can block that thread, never the caller's event loop.

    env = ThreadedEnvironment(task.environment)   # the factory, reset, each step and close run on the thread
    first_prompt = await env.reset(problem)        # the caller's timeouts fire while the thread is blocked

An OpenEnv environment's `step` is synchronous, and any environment's code can block (a `time.sleep` in an
`async def`, a blocking socket): run on the job's event loop, one such call froze the whole job, its timeouts and its
signal handling included. Each episode's environment gets a thread with its own event loop (so an async
environment's resources stay on one loop) from its reset to its close; the thread then serves a later episode (a
thread and a loop per episode cost the job's process ~1 ms of CPU each).

A thread cannot be killed. A call the caller gave up on (timed out, cancelled) leaves its thread blocked until the
call returns, if ever: the thread is stranded, and its environment is closed there once it returns. Stranded
threads are counted (`stranded_threads()`, metric env/stranded_threads); once `MAX_STRANDED` are still blocked, no
new environment starts (`EnvironmentsBlocked`): a process filling up with blocked threads would otherwise fail later
and less clearly. An isolated environment host (rl.environments.actor) is then replaced by a fresh process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine

from rl.environments.protocol import Environment, Observation, StepResult
from forge.metrics import record_metric

MAX_STRANDED = 256  # blocked environment threads a process holds before it refuses new environments

_stranded: set[threading.Thread] = set()
_stranded_lock = threading.Lock()
_idle: list[_Worker] = []  # workers whose last environment closed, ready for the next one


class EnvironmentsBlocked(RuntimeError):
    """Too many environment threads of this process are blocked in calls that were given up on."""


def stranded_threads() -> int:
    """Environment threads still blocked in a call their episode gave up on."""
    with _stranded_lock:
        _stranded.difference_update([t for t in _stranded if not t.is_alive()])
        return len(_stranded)


def _strand(thread: threading.Thread) -> None:
    with _stranded_lock:
        _stranded.add(thread)
    record_metric("env/stranded_threads", stranded_threads(), "max")


class _Worker:
    """A thread running an event loop of its own, serving one environment at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="environment")
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @staticmethod
    def take() -> _Worker:
        with _stranded_lock:
            if _idle:
                return _idle.pop()
        return _Worker()

    def give_back(self) -> None:
        with _stranded_lock:
            _idle.append(self)


class ThreadedEnvironment:
    """The Environment protocol over `factory()`'s environment, every call of it run on the episode's own thread."""

    def __init__(self, factory: Callable[[], Environment], *, max_stranded: int = MAX_STRANDED) -> None:
        self.factory, self.max_stranded = factory, max_stranded
        self.environment: Environment | None = None  # made on the thread, at reset
        self._worker: _Worker | None = None
        # Whether the episode gave up on the thread, and whether the close ran there, decided under one lock: a
        # given-up thread ends after the close, any other serves the next episode.
        self._handoff = threading.Lock()
        self._stranded = self._closed = False
        # Calls submitted to the thread and calls it has finished: they differ while it is still in one.
        self._submitted = self._finished = 0

    async def reset(self, problem: Any) -> Observation:
        self._start()
        return await asyncio.wrap_future(self._submit(self._reset(problem)))

    async def step(self, action: str) -> StepResult:
        if self._worker is None:
            raise RuntimeError("step before reset: the environment was never made")
        return await asyncio.wrap_future(self._submit(self._step(action)))

    async def close(self) -> None:
        """Close the environment on its thread, which then serves another episode. A thread still in a call the
        episode gave up on is not waited for: the close runs there once that call returns, and the thread ends."""
        if self._worker is None:
            return
        if self._submitted != self._finished:
            self._give_up()
            self._submit(self._close())
            return
        try:
            await asyncio.wrap_future(self._submit(self._close()))
        except asyncio.CancelledError:  # the caller's timeout: the close is left to finish there
            self._give_up()
            raise

    def _give_up(self) -> None:
        with self._handoff:
            if self._closed:
                return
            self._stranded = True
        _strand(self._worker.thread)

    def _start(self) -> None:
        if self._worker is not None:
            raise RuntimeError("reset twice: an environment plays one episode")
        if (stranded := stranded_threads()) >= self.max_stranded:
            raise EnvironmentsBlocked(f"{stranded} environment threads of this process are still blocked in calls "
                                      f"that exceeded environment.step_timeout_s (the limit is {self.max_stranded}): "
                                      "the environment blocks on some calls for far longer than that; with "
                                      "environment.isolated=true a fresh environment process replaces a blocked one")
        self._worker = _Worker.take()

    def _submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        self._submitted += 1
        return asyncio.run_coroutine_threadsafe(self._counted(coroutine), self._worker.loop)

    async def _counted(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coroutine
        finally:
            self._finished += 1

    # --- on the environment's thread -----------------------------------------------------------------

    async def _reset(self, problem: Any) -> Observation:
        self.environment = self.factory()
        return await self.environment.reset(problem)

    async def _step(self, action: str) -> StepResult:
        return await self.environment.step(action)

    async def _close(self) -> None:
        try:
            if hasattr(self.environment, "close"):
                await self.environment.close()
        finally:
            with self._handoff:
                self._closed = True
                given_up = self._stranded
            if given_up:  # the thread ends, on the loop's next turn: this call's answer is delivered first
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.stop)
            else:
                self._worker.give_back()
