"""Environments isolated in their own process (forge.environments.actor): a hang or a crash there costs the episodes
it was serving, counted in env/failures; the host comes back and later episodes play."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle

from forge.environments.actor import EnvironmentHost, RemoteEnvironment
from forge.environments.config import EnvironmentConfig
from forge.environments.protocol import StepResult
from forge.environments.rollout import run_episodes
from forge.metrics import drain_local
from forge.types import Completion, SamplingParams

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the host process gets these classes by value


class Fragile:
    """Scores "ok"; blocks its whole process on "hang" (no await: only the caller's timeout ends the wait); kills its
    process on "crash"."""

    async def reset(self, task: str) -> str:
        return task

    async def step(self, action: str) -> StepResult:
        if action == "hang":
            time.sleep(4)
        if action == "crash":
            os._exit(3)
        return StepResult(observation="", reward=1.0, done=True, info={"pid": os.getpid()})


def model_saying(texts: list[str]):
    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [Completion(prompt_ids=p, token_ids=[7], text=texts[p[0]], logprobs=[-1.0], finish_reason="stop",
                           policy_versions=[0]) for p in prompts]
    return generate


async def play(hosts, texts: list[str]):
    async with hosts.session():
        return await run_episodes(model_saying(texts), [RemoteEnvironment(hosts) for _ in texts],
                                  [[i] for i in range(len(texts))], SamplingParams(n=1, max_tokens=1),
                                  EnvironmentConfig(step_timeout_s=2.0), encode=lambda text: [1])


async def test_a_hang_or_a_crash_in_an_isolated_environment_costs_its_episodes_only():
    hosts = await EnvironmentHost.options(num_replicas=1, mesh_name="environments-test").as_service(Fragile)
    drain_local()
    played = await play(hosts, ["ok", "ok"])
    assert [(t.end, t.reward) for t in played] == [("done", 1.0)] * 2

    hung = await play(hosts, ["hang"])
    assert (hung[0].end, hung[0].reward) == ("environment_error", 0.0) and "step_timeout_s=2.0" in hung[0].error
    time.sleep(3)  # the host's blocking call ends; it serves again
    assert [t.reward for t in await play(hosts, ["ok"])] == [1.0]

    crashed = await play(hosts, ["crash"])
    assert crashed[0].end == "environment_error"
    assert drain_local()["env/failures"].value() == 2
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the service restarts the host process
        (again,) = await play(hosts, ["ok"])
        if again.reward == 1.0:
            break
    assert again.reward == 1.0, again.error
    await hosts.stop()
