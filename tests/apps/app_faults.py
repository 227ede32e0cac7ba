"""Faults for the HTTP apps' tests (the gateway's and the training service's): a running app's generator replica
killed until forge.service has no restart left for it (their "no healthy generator replica" answers, 502 and 503),
and actor endpoints that never answer (their 504s, tested without processes)."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from forge.service import Service

# The restarts forge.service gives a replica (the apps' generator services keep the default).
MAX_RESTARTS: int = inspect.signature(Service.__init__).parameters["max_restarts"].default


def newest_job_process(controller_pid: int) -> int:
    """The most recently started Monarch process under the app's controller: a generator replica when the app
    spawned it last (the gateway does at start; a replica's restart spawns only it). Found among the controller's
    descendants (since forge.compat 30 the controller's own environment has no FORGE_JOB_ID to find them by)."""
    found = []
    for proc in psutil.Process(controller_pid).children(recursive=True):
        try:
            if any("monarch" in part for part in proc.cmdline()):
                found.append((proc.create_time(), proc.pid))
        except psutil.Error:
            pass
    assert found, f"no Monarch process under the controller {controller_pid}"
    return max(found)[1]


def kill_the_generator_for_good(controller_pid: int, log: Path, victim: int, serves: Callable[[], None],
                                timeout: float = 240) -> None:
    """SIGKILL the generator replica `victim`, then each restarted replica once `serves()` saw it answer, until the
    replica has no restart left. Each death is checked in the app's log to be the generator's."""
    for death in range(1, MAX_RESTARTS + 2):
        os.kill(victim, signal.SIGKILL)
        failed = f"process {victim} of mesh 'generator-r0"
        restarted = f"replica 0 restarted (restart {death})"
        deadline = time.monotonic() + timeout
        while not (failed in (text := log.read_text()) and (death > MAX_RESTARTS or restarted in text)):
            assert time.monotonic() < deadline, f"death {death} (pid {victim}): no {failed!r} or {restarted!r} " \
                                                f"in the log:\n{text[-3000:]}"
            time.sleep(0.5)
        if death <= MAX_RESTARTS:
            serves()
            victim = newest_job_process(controller_pid)


class Endpoint:
    """Stands in for an actor endpoint (`call`, `call_one`, a service's `route` and `fanout`): answers
    `answer(*args)`, or, with no answer, never (an actor stuck in a call); counts the calls cancelled while they
    waited."""

    def __init__(self, answer: Callable[..., Any] | None = None) -> None:
        self.answer, self.cancelled = answer, 0

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        if self.answer is not None:
            return self.answer(*args)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    call_one = route = fanout = call


def actor(**endpoints: Endpoint) -> Any:
    """A stand-in actor (or service) with these endpoints, and no healthy replica to report."""
    return type("StandIn", (), {**endpoints, "healthy_replicas": lambda self: []})()
