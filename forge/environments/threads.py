"""An episode's environment on a thread of its own: its code can block that thread, never the caller's event loop.

    env = ThreadedEnvironment(task.environment)   # the factory, reset, each step and close run on the thread
    first_prompt = await env.reset(problem)        # the caller's timeouts fire while the thread is blocked

An OpenEnv environment's `step` is synchronous, and any environment's code can block (a `time.sleep` in an
`async def`, a blocking socket): run on the job's event loop, one such call froze the whole job, its timeouts and its
signal handling included. Each episode's environment gets a thread with its own event loop (so an async
environment's resources stay on one loop), started at its reset and ended at its close.

A thread cannot be killed. A call the caller gave up on (timed out, cancelled) leaves its thread blocked until the
call returns, if ever: the thread is stranded, and its environment is closed there once it returns. Stranded
threads are counted (`stranded_threads()`, metric env/stranded_threads); once `MAX_STRANDED` are still blocked, no
new environment starts (`EnvironmentsBlocked`): a process filling up with blocked threads would otherwise fail later
and less clearly. An isolated environment host (forge.environments.actor) is then replaced by a fresh process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine

from forge.environments.protocol import Environment, Observation, StepResult
from forge.metrics import record_metric

MAX_STRANDED = 256  # blocked environment threads a process holds before it refuses new environments

_stranded: set[threading.Thread] = set()
_stranded_lock = threading.Lock()


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


class ThreadedEnvironment:
    """The Environment protocol over `factory()`'s environment, every call of it run on the episode's own thread."""

    def __init__(self, factory: Callable[[], Environment], *, max_stranded: int = MAX_STRANDED) -> None:
        self.factory, self.max_stranded = factory, max_stranded
        self.environment: Environment | None = None  # made on the thread, at reset
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Calls submitted to the thread and calls it has finished: they differ while it is still in one.
        self._submitted = self._finished = 0

    async def reset(self, task: Any) -> Observation:
        self._start()
        return await asyncio.wrap_future(self._submit(self._reset(task)))

    async def step(self, action: str) -> StepResult:
        if self._thread is None:
            raise RuntimeError("step before reset: the environment was never made")
        return await asyncio.wrap_future(self._submit(self._step(action)))

    async def close(self) -> None:
        """Close the environment on its thread and end the thread. A thread still in a call the episode gave up on
        is not waited for: the close runs there once that call returns."""
        if self._thread is None:
            return
        still_in_a_call = self._submitted != self._finished
        closing = self._submit(self._close())
        if still_in_a_call:
            _strand(self._thread)
            return
        try:
            await asyncio.wrap_future(closing)
        except asyncio.CancelledError:  # the caller's timeout: the close is left to finish there
            _strand(self._thread)
            raise

    def _start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("reset twice: an environment plays one episode")
        if (stranded := stranded_threads()) >= self.max_stranded:
            raise EnvironmentsBlocked(f"{stranded} environment threads of this process are still blocked in calls "
                                      f"that exceeded environment.step_timeout_s (the limit is {self.max_stranded}): "
                                      "the environment blocks on some calls for far longer than that; with "
                                      "environment.isolated=true a fresh environment process replaces a blocked one")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="environment")
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        self._submitted += 1
        return asyncio.run_coroutine_threadsafe(self._counted(coroutine), self._loop)

    async def _counted(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coroutine
        finally:
            self._finished += 1

    # --- on the environment's thread -----------------------------------------------------------------

    async def _reset(self, task: Any) -> Observation:
        self.environment = self.factory()
        return await self.environment.reset(task)

    async def _step(self, action: str) -> StepResult:
        return await self.environment.step(action)

    async def _close(self) -> None:
        try:
            if hasattr(self.environment, "close"):
                await self.environment.close()
        finally:
            # Stopped on the loop's next turn, with this call's answer: stopped now, the loop would never deliver it.
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.stop)
