"""How the GRPO job plays and scores prompt groups, for a single-turn task and for a multi-turn one.

Both have `play_groups(problems, params, version) -> [Group | None]`: `params.n` episodes of each problem, generated
with policy `version` or newer and scored, or None where the group's generation failed. Single-turn: one completion
per episode, scored by the task's reward (or the user's). Multi-turn (a task with `environment()`): episodes played
against the task's environments (rl.environments), token in / token out, scored by the environments; an episode whose
environment failed is marked (`Group.failed`): its reward says nothing of what the model wrote, so it is never trained
nor a baseline (`GroupSelector`), and an evaluation leaves it out of its mean.

The groups of one call are generated together: one actor call per healthy generator replica (per turn, for a
multi-turn one, its episodes pinned to that replica by a service session), so a step's many groups cost the controller
a few messages, not one per group. Environments run on threads of their own (rl.environments.threads), or in their own
process with `environment.isolated`: the job's event loop never runs their code.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from apps.grpo.config import TEACHER_WARM_START, GRPOConfig, RolloutConfig
from apps.grpo.launch import JobActors, reward_function
from apps.grpo.rewards import RewardHangError, RewardScorer
from apps.grpo.summary import EpisodeCounters
from forge.metrics import record_metric
from forge.service import NoHealthyReplicaError
from rl.environments.player import EpisodePlayer, start_player
from rl.environments.threads import EnvironmentsBlocked
from rl.environments.trajectory import Trajectory
from rl.tasks.protocol import MultiTurnTask, Task
from rl.types import CompletionBatch, EpisodeBatch, SamplingParams
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.multiturn import warm_start_multiturn
from apps.warm_start.supervised import warm_start_on_task


EPISODE_BITS = 16  # an episode id is its group id, then its index in the group in this many bits
MIN_GROUP = 2  # episodes a group needs to be trained: advantages are relative to the group's other rewards


def episode_ids(group_id: int, n: int) -> list[int]:
    """Unique across groups (rollout.group_size is at most 2**EPISODE_BITS)."""
    return [(group_id << EPISODE_BITS) + i for i in range(n)]


def held_out_score(cfg: GRPOConfig, task: Task) -> str:
    """What the mean of held-out rewards is: "accuracy" when every reward is 0 or 1 (the task's `binary_rewards`;
    without one, forge's own tasks with their exact-match rewards), else "mean reward" (an environment's or a
    dataset's partial scores, or a user's reward function)."""
    binary = getattr(task, "binary_rewards", cfg.task.source == "forge" and cfg.task.reward is None)
    return "accuracy" if binary else "mean reward"


def sampling_params(cfg: GRPOConfig, task: Task, *, greedy: bool = False) -> SamplingParams:
    """A training group's sampling (`rollout.*`), or with `greedy` an evaluation's (one greedy episode)."""
    r, stop = cfg.rollout, list(task.stop_token_ids)
    if greedy:
        return SamplingParams(n=1, max_tokens=r.max_tokens, temperature=0.0, stop_token_ids=stop)
    return SamplingParams(n=r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                          stop_token_ids=stop)


@dataclass
class Group:
    """One prompt's episodes as played and scored. `samples`: the completions (single-turn) or the trajectories
    (multi-turn); `failed[i]`: episode i's environment failed."""

    samples: CompletionBatch | list[Trajectory]
    rewards: list[float]
    failed: list[bool]

    def without_failures(self) -> Group:
        """The episodes whose environment did not fail (only multi-turn episodes have one)."""
        if not any(self.failed):
            return self
        kept = [i for i, failed in enumerate(self.failed) if not failed]
        return Group([self.samples[i] for i in kept], [self.rewards[i] for i in kept], [False] * len(kept))

    def to_episodes(self, group_id: int, advantages: list[float]) -> EpisodeBatch:
        """The group packed for the buffer: straight from the generator's tensors, or from the complete trajectories."""
        ids = episode_ids(group_id, len(self.rewards))
        if isinstance(self.samples, CompletionBatch):
            return EpisodeBatch.from_completions(self.samples, episode_ids=ids, group_ids=[group_id] * len(ids),
                                                 rewards=self.rewards, advantages=advantages)
        return EpisodeBatch.pack([t.to_episode(episode_id=i, group_id=group_id, reward=r, advantage=a)
                                  for t, i, r, a in zip(self.samples, ids, self.rewards, advantages)])


class GroupSelector:
    """Which played groups are trained, with every episode that is not counted (EpisodeCounters, rollout/* metrics).

    - A group whose generation failed has no episodes (`generation_failures`).
    - Episodes whose environment failed are left out (`environment_failures`); the rest of the group is trained when at
      least MIN_GROUP are left, else dropped with them (`environment_dropped` counts both).
    - With `drop_zero_variance_groups`, a group whose rewards are all equal carries no signal and is dropped
      (`zero_variance_dropped`), at most `max_dropped_groups_per_step` a step (`new_step`)."""

    def __init__(self, cfg: RolloutConfig, counters: EpisodeCounters) -> None:
        self.cfg, self.counters = cfg, counters
        self.dropped_this_step = 0  # zero-variance groups

    def new_step(self) -> None:
        self.dropped_this_step = 0

    def trainable(self, group: Group | None) -> Group | None:
        c = self.counters
        if group is None:
            c.generation_failures += 1
            record_metric("rollout/generation_failures", 1, "sum")
            return None
        failures = sum(group.failed)
        kept = group.without_failures()
        if failures:
            c.environment_failures += failures
            record_metric("rollout/environment_failures", failures, "sum")
        if len(kept.rewards) < MIN_GROUP:
            self._drop("environment", len(group.rewards))
            return None
        self._drop("environment", failures)
        record_metric("rollout/reward_mean", sum(kept.rewards) / len(kept.rewards))  # groups' means, over the step
        budget = self.cfg.max_dropped_groups_per_step
        if (self.cfg.drop_zero_variance_groups and all(r == kept.rewards[0] for r in kept.rewards)
                and (budget is None or self.dropped_this_step < budget)):
            self.dropped_this_step += 1
            self._drop("zero_variance", len(kept.rewards))
            return None
        return kept

    def _drop(self, reason: str, episodes: int) -> None:
        if episodes:
            self.counters.generated += episodes
            setattr(self.counters, f"{reason}_dropped", getattr(self.counters, f"{reason}_dropped") + episodes)
            record_metric(f"rollout/{reason}_dropped", episodes, "sum")


FATAL = (NoHealthyReplicaError, RewardHangError, EnvironmentsBlocked)  # the job's end, not one group's


async def _per_replica(generators: Any, problems: list, play: Callable[[list], Awaitable[list]]) -> list:
    """`play(part)` for even parts of `problems`, one per healthy replica, concatenated in order. A part that fails
    (e.g. a prompt over the engine's window) is played again problem by problem, so that only the problems that fail
    alone get None."""
    chunk = max(1, math.ceil(len(problems) / max(1, len(generators.healthy_replicas()))))
    parts = await asyncio.gather(*(_alone_on_failure(problems[i : i + chunk], play)
                                   for i in range(0, len(problems), chunk)))
    return [x for part in parts for x in part]


async def _alone_on_failure(part: list, play: Callable[[list], Awaitable[list]]) -> list:
    try:
        return await play(part)
    except FATAL:
        raise
    except Exception as e:
        if len(part) > 1:
            return [x for one in await asyncio.gather(*(_alone_on_failure([p], play) for p in part)) for x in one]
        print(f"generation failed for prompt {getattr(part[0], 'prompt', part[0])!r:.60}: {e}", file=sys.stderr)
        return [None]


class SingleTurn:
    def __init__(self, generators: Any, rewards: RewardScorer) -> None:
        self.generators, self.rewards = generators, rewards

    @property
    def reward_failures(self) -> int:
        return self.rewards.failures

    async def play_groups(self, problems: list, params: SamplingParams, version: int = 0) -> list[Group | None]:
        async def play(part: list) -> list[Group]:
            completions = await self.generators.generate_batch.route([p.prompt for p in part], params,
                                                                     min_policy_version=version)
            groups = [completions[i : i + 1] for i in range(len(part))]
            rewards = await asyncio.gather(*(self.rewards.score(g.texts, p.answer) for g, p in zip(groups, part)))
            return [Group(g, r, [False] * len(r)) for g, r in zip(groups, rewards)]

        return await _per_replica(self.generators, problems, play)


class MultiTurn:
    reward_failures = 0  # its environments score it

    def __init__(self, player: EpisodePlayer) -> None:
        self.player, self.generators = player, player.generators

    async def play_groups(self, problems: list, params: SamplingParams, version: int = 0) -> list[Group | None]:
        async def play(part: list) -> list[Group]:
            played = await self.player.play([p for p in part for _ in range(params.n)], params, version)
            groups = [played[i : i + params.n] for i in range(0, len(played), params.n)]
            return [Group(g, [t.reward for t in g], [t.failed for t in g]) for g in groups]

        return await _per_replica(self.generators, problems, play)


async def evaluate(rollout: SingleTurn | MultiTurn, problems: list, params: SamplingParams) -> list[float | None]:
    """Each problem's reward with `params` (n=1); None where its generation or its environment failed."""
    groups = await rollout.play_groups(problems, params)
    return [None if g is None or g.failed[0] else g.rewards[0] for g in groups]


async def make_rollout(cfg: GRPOConfig, task: Task, actors: JobActors) -> SingleTurn | MultiTurn:
    """A single-turn task's rollout scores with the task's reward (or the user's, `task.reward`); a multi-turn task's
    starts its environment host first when `environment.isolated`."""
    if not isinstance(task, MultiTurnTask):
        reward, timeout_s = reward_function(cfg, task)
        return SingleTurn(actors.generators, RewardScorer(reward, timeout_s, name=f"task.reward={cfg.task.reward}"))
    return MultiTurn(await start_player(task, actors.tokenizer, cfg.environment, actors.generators,
                                        cfg.task.chat_template_kwargs))


def warm_started_model(cfg: GRPOConfig, task: Task,
                       settings: WarmStartConfig | None = None) -> tuple[str, float | None]:
    """`cfg.model`, first trained briefly on the task when `warm_start.enabled` (cached by its inputs): a multi-turn
    task on its correct episodes (apps.warm_start.multiturn), a single-turn task on its reference answers
    (apps.warm_start.supervised, apps.sft's examples: arithmetic, GSM8K, reasoning-gym).
    `settings`: other warm-start settings than `cfg.warm_start` (a distillation teacher's: `teacher_model`)."""
    settings = cfg.warm_start if settings is None else settings
    if not settings.enabled:
        return cfg.model, None
    if not isinstance(task, MultiTurnTask):
        return warm_start_on_task(cfg.model, cfg.model_cache, task, settings, seed=cfg.seed,
                                  max_tokens=cfg.rollout.max_tokens)
    eval_problems = task.sample_prompts(settings.eval_prompts, random.Random(f"{cfg.seed}-warm-start-eval"))
    train_rng = random.Random(f"{cfg.seed}-warm-start")
    path, accuracy = warm_start_multiturn(cfg.model, Path(cfg.model_cache) / "warm_start", task=task,
                                          task_name=cfg.task.name,
                                          train_problems=lambda n: task.sample_prompts(n, train_rng),
                                          eval_problems=eval_problems, limits=cfg.environment,
                                          config=settings, seed=cfg.seed, max_tokens=cfg.rollout.max_tokens)
    return str(path), accuracy


def teacher_model(cfg: GRPOConfig, task: Task) -> tuple[str | None, float | None]:
    """The distillation teacher's checkpoint (None without one) and, when forge trains it, its warm start's accuracy:
    `teacher.model: warm_start` is the task's warm start (`warm_started_model`) trained on to
    `teacher.warm_start_accuracy`, cached by its inputs like the student's."""
    if cfg.teacher.model != TEACHER_WARM_START:
        return cfg.teacher.model, None
    settings = replace(cfg.warm_start, enabled=True, target_accuracy=cfg.teacher.warm_start_accuracy)
    return warm_started_model(cfg, task, settings)
