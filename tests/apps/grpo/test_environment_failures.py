"""Where environments meet the GRPO job: a group with an episode whose environment failed is dropped whole, counted in
the episode accounting and the summary, never trained as if the model earned reward 0;
in-process environments never run on the job's event loop; a task with partial rewards is scored as a mean reward."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from types import SimpleNamespace

import pytest

from apps.grpo.config import RolloutConfig
from apps.grpo.main import GRPOJob
from apps.grpo.rollouts import MultiTurn, held_out_score
from apps.grpo.summary import EpisodeCounters, RunSummary
from rl.environments.config import EnvironmentConfig
from rl.environments.openenv import OpenEnvSpec
from rl.environments.threads import stranded_threads
from forge.metrics import drain_local
from rl.tasks import TaskConfig
from rl.types import Completion, SamplingParams

SLEEPY = "tests.rl.environments.openenv_sleepy:SleepyEnvironment"


class FakeGenerators:
    """A generator service whose model writes `texts[k]` as its k-th completion (one token each)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.generate_batch = iter(texts), self

    @contextlib.asynccontextmanager
    async def session(self):
        yield self

    def healthy_replicas(self) -> list[int]:
        return [0]

    async def route_batch(self, prompts, params, min_policy_version=0):
        return [[Completion(prompt_ids=list(p), token_ids=[5], text=next(self.texts), logprobs=[-1.0],
                            finish_reason="stop", policy_versions=[0])] for p in prompts]


class Tokenizer:
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [10 + (ord(c) % 50) for c in text]


def multi_turn(texts: list[str], step_timeout_s: float = 0.5) -> MultiTurn:
    spec = OpenEnvSpec.resolve(SLEEPY, options={"sleep_s": 5.0})
    cfg = SimpleNamespace(environment=EnvironmentConfig(step_timeout_s=step_timeout_s), task=TaskConfig())
    return MultiTurn(cfg, SimpleNamespace(environment=spec.environment), Tokenizer(), FakeGenerators(texts), None)


async def test_an_in_process_environment_that_blocks_costs_its_episode_and_the_others_play_on():
    rollout = multi_turn(["1", "sleep", "0", "1"])
    drain_local()
    started = time.monotonic()
    trajectories, rewards, failed = await rollout.group(SimpleNamespace(seed=3), SamplingParams(n=4, max_tokens=1), 0)
    assert time.monotonic() - started < 4  # the blocked step (5 s) held its own thread, not the job's event loop
    assert failed == 1 and [t.end for t in trajectories] == ["done", "environment_error", "done", "done"]
    assert [rewards[i] for i in (0, 2, 3)] == [1.0, 0.5, 1.0]
    # evaluation leaves it out too
    evaluated = await multi_turn(["sleep", "1"]).evaluate([SimpleNamespace(seed=1)] * 2,
                                                          SamplingParams(n=1, max_tokens=1))
    assert evaluated == [None, 1.0]
    drain_local()
    deadline = time.monotonic() + 15
    while stranded_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


class FakeRollout:
    """A group of 4 whose 2nd episode failed in its environment."""

    async def group(self, problem, params, version):
        return ["a", "b", "c", "d"], [1.0, 0.0, 0.0, 1.0], 1

    @staticmethod
    def to_episodes(samples, *, group_id, rewards, advantages):
        raise AssertionError("a group with a failed environment is never packed for the buffer")


class Buffer:
    def __init__(self) -> None:
        self.released, self.added = 0, []
        self.release, self.add = SimpleNamespace(call_one=self._release), SimpleNamespace(call_one=self._add)

    async def _release(self, count: int) -> None:
        self.released += count

    async def _add(self, episodes, reserved: bool) -> None:
        self.added.append(episodes)


def job_with(rollout) -> GRPOJob:
    job = GRPOJob.__new__(GRPOJob)
    job.cfg = SimpleNamespace(rollout=RolloutConfig(group_size=4, drop_zero_variance_groups=True))
    job.task = SimpleNamespace(sample_prompts=lambda n, rng: [SimpleNamespace(prompt="p")] * n)
    job.rollout, job.rng, job.counters = rollout, random.Random(0), EpisodeCounters()
    job.rewards_this_step, job.groups_dropped_this_step = [], 0
    job.actors = SimpleNamespace(reference=None, buffer=Buffer())
    job._scored, job._buffer_writer, job.arrived = [], asyncio.Lock(), asyncio.Event()
    job._unreleased, job._buffer_releaser = 0, asyncio.Lock()
    return job


async def test_a_group_with_a_failed_environment_is_dropped_whole_counted_and_its_room_given_back():
    job = job_with(FakeRollout())
    drain_local()
    await job.one_group(SamplingParams(n=4, max_tokens=1), version=0)
    assert job.actors.buffer.added == [] and job.actors.buffer.released == 4
    c = job.counters
    assert (c.generated, c.environment_failures, c.environment_dropped, c.zero_variance_dropped) == (4, 1, 4, 0)
    assert job.rewards_this_step == []  # rollout/reward_mean is over trained groups only: no 0 for the failure
    metrics = drain_local()
    assert metrics["rollout/environment_failures"].value() == 1
    assert metrics["rollout/environment_dropped"].value() == 4


def test_partial_rewards_are_a_mean_reward_and_exact_match_ones_an_accuracy():
    task = SimpleNamespace()
    assert held_out_score(SimpleNamespace(task=TaskConfig(source="forge", name="lookup")), task) == "accuracy"
    openenv = SimpleNamespace(task=SimpleNamespace(source="openenv", reward=None))
    assert held_out_score(openenv, task) == "mean reward"
    assert held_out_score(openenv, SimpleNamespace(binary_rewards=True)) == "accuracy"  # the task says so
    user_reward = SimpleNamespace(task=SimpleNamespace(source="forge", reward="my.module:partial"))
    assert held_out_score(user_reward, task) == "mean reward"

    summary = RunSummary(held_out_score="mean reward", accuracy_start=0.55, accuracy_end=0.8,
                         eval_environment_failures=3)
    summary.count_episodes(EpisodeCounters(), {"consumed": 0, "held": 0, "dropped_too_old": 0,
                                               "dropped_buffer_full": 0})
    text = summary.text()
    assert "held-out mean reward: 0.550 -> 0.800 (+0.250); 3 held-out episodes left out" in text
    assert "accuracy" not in text and summary.score_metric == "eval/mean_reward"
