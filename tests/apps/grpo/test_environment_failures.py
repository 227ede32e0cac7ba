"""Where environments meet the GRPO job: an episode whose environment failed is dropped (its group with it when fewer
than 2 episodes are left), counted in the episode accounting and the summary, never trained as if the model earned
reward 0; in-process environments never run on the job's event loop; a task with partial rewards is scored as a mean
reward."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from types import SimpleNamespace

import pytest

from apps.grpo.config import RolloutConfig
from apps.grpo.main import GRPOJob
from apps.grpo.rollouts import GroupSelector, HeldOut, held_out_score
from apps.grpo.summary import EpisodeCounters, RunSummary
from rl.environments.trajectory import Trajectory
from rl.environments.config import EnvironmentConfig
from rl.environments.openenv import OpenEnvSpec
from rl.environments.player import EpisodePlayer
from rl.environments.threads import stranded_threads
from rl.rollout import Group, MultiTurn
from forge.metrics import drain_local
from rl.tasks import TaskConfig
from rl.types import Completion, SamplingParams

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

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

    async def route(self, prompts, params, min_policy_version=0):
        return [[Completion(prompt_ids=list(p), token_ids=[5], text=next(self.texts), logprobs=[-1.0],
                            finish_reason="stop", policy_versions=[0])] for p in prompts]


class Tokenizer:
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [10 + (ord(c) % 50) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(40 + i) for i in ids)


def multi_turn(texts: list[str], step_timeout_s: float = 0.5) -> MultiTurn:
    spec = OpenEnvSpec.resolve(SLEEPY, options={"sleep_s": 5.0})
    return MultiTurn(EpisodePlayer(SimpleNamespace(environment=spec.environment), Tokenizer(),
                                   EnvironmentConfig(step_timeout_s=step_timeout_s), FakeGenerators(texts)))


async def test_an_in_process_environment_that_blocks_costs_its_episode_and_the_others_play_on():
    rollout = multi_turn(["1", "sleep", "0", "1"])
    drain_local()
    started = time.monotonic()
    (group,) = await rollout.play_groups([SimpleNamespace(seed=3)], SamplingParams(n=4, max_tokens=1), 0)
    assert time.monotonic() - started < 4  # the blocked step (5 s) held its own thread, not the job's event loop
    assert group.failed == [False, True, False, False]
    assert [t.end for t in group.samples] == ["done", "environment_error", "done", "done"]
    assert [group.rewards[i] for i in (0, 2, 3)] == [1.0, 0.5, 1.0]
    # the held-out evaluation leaves it out too, counted with its reason (apps/held_out/'s rules)
    cfg = SimpleNamespace(task=SimpleNamespace(reward=None), eval=SimpleNamespace(num_prompts=2),
                          rollout=SimpleNamespace(max_tokens=1))
    task = SimpleNamespace(held_out=lambda: [SimpleNamespace(seed=1)] * 2, stop_token_ids=[], reward=None)
    score = await HeldOut(cfg, task, multi_turn(["sleep", "1"]), Tokenizer()).score("end")
    assert score.mean_reward == 1.0 and score.failed_samples == 1
    assert next(iter(score.failures)).startswith("EnvironmentFailed: ")
    drain_local()
    deadline = time.monotonic() + 15
    while stranded_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def played(rewards: list[float], failed: list[bool]) -> Group:
    """A multi-turn group of one-token episodes."""
    trajectories = [Trajectory(prompt_ids=[1], completion_ids=[5], mask=[1], logprobs=[-1.0], versions=[0],
                               end="environment_error" if f else "done") for f in failed]
    return Group(trajectories, rewards, failed)


class FakeRollout:
    """Two groups of 4: the first's 2nd episode failed in its environment, three of the second's did."""

    async def play_groups(self, problems, params, version):
        return [played([1.0, 0.0, 0.0, 1.0], [False, True, False, False]),
                played([1.0, 0.0, 0.0, 0.0], [True, True, False, True])]


def job_with(rollout) -> GRPOJob:
    job = GRPOJob.__new__(GRPOJob)
    job.cfg = SimpleNamespace(rollout=RolloutConfig(group_size=4, drop_zero_variance_groups=True))
    job.task = SimpleNamespace(sample_prompts=lambda n, rng: [SimpleNamespace(prompt="p")] * n, stop_token_ids=[])
    job.rollout, job.rng = rollout, random.Random(0)
    job.selector = GroupSelector(job.cfg.rollout, EpisodeCounters())
    return job


async def test_only_the_failed_episodes_are_dropped_while_two_or_more_of_their_group_are_left():
    job = job_with(FakeRollout())
    drain_local()
    episodes = await job.generate(2, version=0)  # the scheduler adds them, settling both groups' room
    assert episodes.rewards.tolist() == [1.0, 0.0, 1.0]  # the first group without its failed episode
    advantages = episodes.advantages.tolist()  # relative to the 3 left: the failure is not their baseline
    assert abs(sum(advantages)) < 1e-5 and advantages[0] == advantages[2] > 0 > advantages[1]
    c = job.selector.counters
    assert (c.generated, c.environment_failures, c.environment_dropped, c.zero_variance_dropped) == (8, 4, 5, 0)
    metrics = drain_local()
    assert metrics["rollout/environment_failures"].value() == 4
    assert metrics["rollout/environment_dropped"].value() == 5  # 1 episode, then the second group's 4 (1 left)


def test_a_group_with_nothing_but_failures_or_one_episode_left_is_dropped_whole():
    selector = GroupSelector(RolloutConfig(group_size=4), EpisodeCounters())
    assert selector.trainable(played([0.0] * 4, [True] * 4)) is None
    assert selector.trainable(played([1.0, 0.0, 0.0, 0.0], [False, True, True, True])) is None
    assert selector.trainable(None) is None  # its generation failed
    kept = selector.trainable(played([1.0, 0.0, 0.0, 0.0], [False, False, True, True]))
    assert kept.rewards == [1.0, 0.0] and kept.failed == [False, False] and len(kept.samples) == 2
    c = selector.counters
    assert (c.generated, c.environment_failures, c.environment_dropped, c.generation_failures) == (10, 9, 10, 1)


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
