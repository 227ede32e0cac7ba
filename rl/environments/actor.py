"""Environments in their own process: a crash or a blocking call there costs the episodes it was serving (their
calls fail or exceed `step_timeout_s`, counted in env/failures), never the job.

    hosts = await EnvironmentHost.options(num_replicas=1).as_service(task.environment)   # a picklable factory
    async with hosts.session():               # a group's episodes on one replica, where their environments live
        envs = [RemoteEnvironment(hosts) for _ in range(G)]   # the Environment protocol, served by that process

A host serves many episodes at once, each an environment made by the factory, keyed by the episode, each on a thread
of its own (rl.environments.threads): an environment that blocks holds its thread, never the host, and the
host's other episodes play on. A replica that dies is restarted by the service (forge.service); the episodes it held
fail (their next step finds no environment). A host whose environment threads are stranded (`max_stranded` of them
still blocked in calls the rollout gave up on) cannot be cleared from inside: it exits, and its service replaces it
with a fresh process.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, Callable

from forge.actor import ForgeActor, endpoint
from rl.environments.protocol import Environment, Observation, StepResult
from rl.environments.threads import MAX_STRANDED, ThreadedEnvironment, stranded_threads

_keys = itertools.count()


EXIT_STRANDED = 75  # the host's exit status when it leaves so that a fresh process replaces it


class EnvironmentHost(ForgeActor):
    def __init__(self, factory: Callable[[], Environment], max_stranded: int = MAX_STRANDED) -> None:
        self.factory, self.max_stranded = factory, max_stranded
        self.environments: dict[int, ThreadedEnvironment] = {}

    @endpoint
    async def reset(self, key: int, problem: Any) -> Observation:
        if (stranded := stranded_threads()) >= self.max_stranded:
            # A thread cannot be killed, a process can: the service starts a fresh host (this episode fails).
            print(f"environment host (pid {os.getpid()}): {stranded} environment threads are still blocked in calls "
                  "that exceeded environment.step_timeout_s; exiting so that a fresh process replaces this one",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_STRANDED)
        self.environments[key] = environment = ThreadedEnvironment(self.factory, max_stranded=self.max_stranded)
        return await environment.reset(problem)

    @endpoint
    async def step(self, key: int, action: str) -> StepResult:
        if key not in self.environments:
            raise KeyError(f"no environment for episode {key} on this host (never reset, already done, or the host "
                           "restarted since)")
        return await self.environments[key].step(action)

    @endpoint
    async def close(self, key: int) -> None:
        environment = self.environments.pop(key, None)
        if environment is not None:
            await environment.close()

    @endpoint
    async def stranded_threads(self) -> int:
        return stranded_threads()


class RemoteEnvironment:
    """One episode's environment on an `EnvironmentHost` service (the Environment protocol). Play a group inside
    `async with hosts.session():` so its episodes' calls all reach the replica holding their environments."""

    def __init__(self, hosts: Any) -> None:
        self.hosts, self.key = hosts, next(_keys)

    async def reset(self, problem: Any) -> Observation:
        return await self.hosts.reset.route(self.key, problem)

    async def step(self, action: str) -> StepResult:
        return await self.hosts.step.route(self.key, action)

    async def close(self) -> None:
        await self.hosts.close.route(self.key)
