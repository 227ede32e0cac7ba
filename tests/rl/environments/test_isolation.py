"""Environments isolated in their own process (rl.environments.actor): a hang or a crash there costs the episodes
it was serving, counted in env/failures; a blocking step holds its own thread, never the host, so later episodes play
at once; a host with too many stranded threads, or one that crashed, is replaced by a fresh process."""

from __future__ import annotations

import pytest

import os
import sys
import time

import cloudpickle

from rl.environments.actor import EnvironmentHost, RemoteEnvironment
from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import StepResult
from rl.environments.rollout import run_episodes
from forge.metrics import drain_local
from rl.types import Completion, SamplingParams

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the host process gets these classes by value


class Fragile:
    """Scores "ok" 1 and "pid" its process's id; blocks its thread for 30 s on "hang" (no await: only the caller's
    timeout ends the wait); kills its process on "crash"."""

    async def reset(self, task: str) -> str:
        return task

    async def step(self, action: str) -> StepResult:
        if action == "hang":
            time.sleep(30)
        if action == "crash":
            os._exit(3)
        return StepResult(observation="", reward=float(os.getpid()) if action == "pid" else 1.0, done=True)


def model_saying(texts: list[str]):
    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [Completion(prompt_ids=p, token_ids=[7], text=texts[p[0]], logprobs=[-1.0], finish_reason="stop",
                           policy_versions=[0]) for p in prompts]
    return generate


async def play(hosts, texts: list[str]) -> list:
    async with hosts.session():
        return await run_episodes(model_saying(texts), [RemoteEnvironment(hosts) for _ in texts],
                                  [[i] for i in range(len(texts))], SamplingParams(n=1, max_tokens=1),
                                  EnvironmentConfig(step_timeout_s=2.0), encode=lambda text: [1])


async def host_pid(hosts, wait_s: float = 120) -> int:
    """The process id of the host that serves the first episode that plays (while the service replaces a host)."""
    deadline = time.monotonic() + wait_s
    while True:
        (t,) = await play(hosts, ["pid"])
        if t.end == "done":
            return int(t.reward)
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no episode played within {wait_s} s: {t.error}")


async def test_a_hang_or_a_crash_in_an_isolated_environment_costs_its_episodes_only():
    hosts = await EnvironmentHost.options(num_replicas=1, mesh_name="environments-test").as_service(Fragile,
                                                                                                   max_stranded=2)
    drain_local()
    played = await play(hosts, ["ok", "ok"])
    assert [(t.end, t.reward) for t in played] == [("done", 1.0)] * 2
    first_host = await host_pid(hosts, wait_s=0)

    hung = await play(hosts, ["hang", "ok"])  # one episode blocks its thread; its group's other one plays
    assert [t.end for t in hung] == ["environment_error", "done"] and "step_timeout_s=2.0" in hung[0].error
    assert drain_local()["env/failures"].value() == 1
    assert await host_pid(hosts, wait_s=0) == first_host  # at once, on the same host: it was never blocked
    assert await hosts.stranded_threads.route() == 1

    await play(hosts, ["hang"])  # a second stranded thread: the host's limit
    second_host = await host_pid(hosts)
    assert second_host != first_host  # replaced by a fresh process, which serves

    crashed = await play(hosts, ["crash"])
    assert crashed[0].end == "environment_error"
    assert await host_pid(hosts) not in (first_host, second_host)
    await hosts.stop()
