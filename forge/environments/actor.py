"""Environments in their own process: a crash or a blocking call there costs the episodes it was serving (their
calls fail or exceed `step_timeout_s`, counted in env/failures), never the job.

    hosts = await EnvironmentHost.options(num_replicas=1).as_service(task.environment)   # a picklable factory
    async with hosts.session():               # a group's episodes on one replica, where their environments live
        envs = [RemoteEnvironment(hosts) for _ in range(G)]   # the Environment protocol, served by that process

A host serves many episodes at once, each an environment made by the factory, keyed by the episode. A replica that
dies is restarted by the service (forge.service); the episodes it held fail (their next step finds no environment).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from forge.actor import ForgeActor, endpoint
from forge.environments.protocol import Environment, Observation, StepResult

_keys = itertools.count()


class EnvironmentHost(ForgeActor):
    def __init__(self, factory: Callable[[], Environment]) -> None:
        self.factory = factory
        self.environments: dict[int, Environment] = {}

    @endpoint
    async def reset(self, key: int, task: Any) -> Observation:
        self.environments[key] = environment = self.factory()
        return await environment.reset(task)

    @endpoint
    async def step(self, key: int, action: str) -> StepResult:
        if key not in self.environments:
            raise KeyError(f"no environment for episode {key} on this host (never reset, already done, or the host "
                           "restarted since)")
        return await self.environments[key].step(action)

    @endpoint
    async def close(self, key: int) -> None:
        environment = self.environments.pop(key, None)
        if hasattr(environment, "close"):
            await environment.close()

    @endpoint
    async def open_episodes(self) -> int:
        return len(self.environments)


class RemoteEnvironment:
    """One episode's environment on an `EnvironmentHost` service (the Environment protocol). Play a group inside
    `async with hosts.session():` so its episodes' calls all reach the replica holding their environments."""

    def __init__(self, hosts: Any) -> None:
        self.hosts, self.key = hosts, next(_keys)

    async def reset(self, task: Any) -> Observation:
        return await self.hosts.reset.route(self.key, task)

    async def step(self, action: str) -> StepResult:
        return await self.hosts.step.route(self.key, action)

    async def close(self) -> None:
        await self.hosts.close.route(self.key)
