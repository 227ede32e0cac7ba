"""Environments on threads of their own (rl.environments.threads): an environment whose code blocks (an OpenEnv
environment's synchronous step sleeping) costs its episode, never the caller's event loop; its stranded thread is
counted, not waited for, bounded, and ends once its call returns; other threads serve one episode after another."""

from __future__ import annotations

import asyncio
import time

import pytest

from rl.environments.config import EnvironmentConfig
from rl.environments.openenv import OpenEnvSpec
from rl.environments.rollout import run_episodes
from rl.environments.threads import EnvironmentsBlocked, ThreadedEnvironment, stranded_threads
from forge.metrics import drain_local
from rl.types import Completion, SamplingParams

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)

SLEEPY = "tests.rl.environments.openenv_sleepy:SleepyEnvironment"


def sleepy(sleep_s: float):
    return OpenEnvSpec.resolve(SLEEPY, options={"sleep_s": sleep_s}).environment


def model_saying(texts: list[str]):
    """Episode i's model writes texts[i] (the episode told apart by its task, its prompt's first token)."""
    async def generate(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [Completion(prompt_ids=p, token_ids=[7], text=texts[p[0]], logprobs=[-1.0], finish_reason="stop",
                           policy_versions=[0]) for p in prompts]
    return generate


async def play(environments, texts: list[str], step_timeout_s: float = 0.5):
    # the reset observation is replaced by each episode's index, so the fake model tells episodes apart
    return await run_episodes(model_saying(texts), environments, list(range(len(texts))),
                              SamplingParams(n=1, max_tokens=1), EnvironmentConfig(step_timeout_s=step_timeout_s),
                              encode=lambda text: [])


class Indexed:
    """An environment whose first prompt is the episode's index (its task), around an OpenEnv one."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def reset(self, task: int) -> list[int]:
        await self.inner.reset(type("Problem", (), {"seed": task})())
        return [task]

    async def step(self, action: str):
        return await self.inner.step(action)

    async def close(self) -> None:
        await self.inner.close()


async def test_a_blocking_synchronous_step_costs_its_episode_and_the_event_loop_runs_on():
    make = sleepy(sleep_s=5.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticking = asyncio.ensure_future(ticker())
    drain_local()
    started = time.monotonic()
    blocked, ok = await play([ThreadedEnvironment(lambda: Indexed(make())) for _ in range(2)], ["sleep", "1"])
    took = time.monotonic() - started
    ticking.cancel()
    assert (blocked.end, ok.end, ok.reward) == ("environment_error", "done", 1.0)
    assert "step_timeout_s=0.5" in blocked.error
    assert took < 4  # the group did not wait for the 5 s sleep, nor for a close behind it
    assert ticks >= 5  # the event loop ran while the step slept
    assert stranded_threads() >= 1  # the sleeping thread, counted until it returns
    # Later episodes play, on threads of their own.
    (again,) = await play([ThreadedEnvironment(lambda: Indexed(make()))], ["1"])
    assert (again.end, again.reward) == ("done", 1.0)
    deadline = time.monotonic() + 10
    while stranded_threads() and time.monotonic() < deadline:  # the sleep ends, the close runs there, the thread ends
        await asyncio.sleep(0.1)
    assert stranded_threads() == 0
    metrics = drain_local()
    assert metrics["env/stranded_threads"].value() >= 1
    assert metrics["env/failures"].value() == 1  # the blocked step; every close answered


async def test_past_max_stranded_threads_no_environment_starts_and_the_rollout_says_why():
    make = sleepy(sleep_s=2.0)
    await play([ThreadedEnvironment(lambda: Indexed(make()))], ["sleep"], step_timeout_s=0.2)
    assert stranded_threads() >= 1
    with pytest.raises(EnvironmentsBlocked, match=r"still blocked in calls that exceeded environment.step_timeout_s"):
        await play([ThreadedEnvironment(lambda: Indexed(make()), max_stranded=1)], ["1"])
    drain_local()
    deadline = time.monotonic() + 10
    while stranded_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def test_the_factory_runs_on_the_environments_thread_which_serves_the_next_episode_after_its_close():
    import threading

    made_on = []

    class Recording:
        def __init__(self) -> None:
            made_on.append(threading.current_thread())

        async def reset(self, task):
            return [task]

        async def step(self, action):
            from rl.environments.protocol import StepResult
            return StepResult(observation="", reward=1.0, done=True)

    (t,) = await play([ThreadedEnvironment(Recording)], ["1"])
    assert t.end == "done" and made_on[0] is not threading.current_thread()
    (t,) = await play([ThreadedEnvironment(Recording)], ["1"])
    assert t.end == "done" and made_on[1] is made_on[0]  # no thread and loop made per episode
