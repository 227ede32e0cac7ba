"""The rollout: how every app plays a task's problems through forge's generator service, single-turn or multi-turn.

    rollout = SingleTurn(generators, rewards)        # or MultiTurn(await start_player(task, ...)) for a MultiTurnTask
    groups = await rollout.play_groups(problems, params, version)

`play_groups(problems, params, version) -> [Group | Exception]`: `params.n` episodes of each problem, generated with
policy `version` or newer, or the error where the problem's generation failed. Single-turn: one completion per
episode, scored by `rewards` (the task's reward or the user's; without one the group is unscored and the caller scores
the completions' texts, as apps.eval does with its own failure rules). Multi-turn: episodes played against the task's
environments (rl.environments), token in / token out, scored by the environments; an episode whose environment failed
is marked (`Group.failed`): its reward says nothing of what the model wrote, so it is never trained nor a baseline,
and an evaluation leaves it out.

The groups of one call are generated together: one actor call per healthy generator replica (per turn, for a
multi-turn one, its episodes pinned to that replica by a service session), so a step's many groups cost the caller a
few messages, not one per group. apps.grpo trains on these groups; apps.eval and apps.sft score held-out problems with
them (apps/eval/samplers.py).

`SingleTurn(..., keep_at_most=k)` (apps.grpo's training rollout) leaves the completions' tensors on the generator
replicas (`KeptGroup`: their texts to score, and where they are); `buffer_episodes` then names the rows to train for
the replay buffer to take from those replicas, so a group's tokens never pass through the caller.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Protocol

from forge.service import NoHealthyReplicaError
from rl.environments.player import EpisodePlayer
from rl.environments.threads import EnvironmentsBlocked
from rl.environments.trajectory import Trajectory
from rl.tasks.protocol import TaskProblem
from rl.types import CompletionBatch, EpisodeBatch, KeptEpisodes, KeptPart, SamplingParams

EPISODE_BITS = 16  # an episode id is its group id, then its index in the group in this many bits


def episode_ids(group_id: int, n: int) -> list[int]:
    """Unique across groups (a group has at most 2**EPISODE_BITS episodes)."""
    return [(group_id << EPISODE_BITS) + i for i in range(n)]


class FatalRolloutError(RuntimeError):
    """Raised by a part of a rollout (its reward scorer) when the job cannot go on: never retried problem by problem,
    it ends the call."""


# The job's end, not one problem's: re-raised, never turned into a failed group.
FATAL = (NoHealthyReplicaError, FatalRolloutError, EnvironmentsBlocked)


@dataclass
class KeptGroup:
    """One problem's completions as a generator replica keeps them (`Generator.generate_kept`): their texts, to score,
    and where their tensors are: rows `rows` of the batch `key` kept by the replica `generator`."""

    generator: Any  # the replica's actor handle
    key: int
    rows: range
    texts: list[str]


@dataclass
class Group:
    """One problem's episodes as played and scored. `samples`: the completions (single-turn; kept on their generator
    replica with `SingleTurn(keep_at_most=...)`) or the trajectories (multi-turn); `rewards`: one per episode (empty
    when a single-turn rollout has no scorer); `failed[i]`: episode i's environment failed."""

    samples: CompletionBatch | KeptGroup | list[Trajectory]
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
        if isinstance(self.samples, KeptGroup):
            raise TypeError("Group.to_episodes: the completions are kept on their generator replica; "
                            "buffer_episodes names them for the replay buffer to take")
        if isinstance(self.samples, CompletionBatch):
            return EpisodeBatch.from_completions(self.samples, episode_ids=ids, group_ids=[group_id] * len(ids),
                                                 rewards=self.rewards, advantages=advantages)
        return EpisodeBatch.pack([t.to_episode(episode_id=i, group_id=group_id, reward=r, advantage=a)
                                  for t, i, r, a in zip(self.samples, ids, self.rewards, advantages)])


def buffer_episodes(played: Sequence[Group | Exception],
                    trained: Sequence[tuple[Group, int, list[float]]]) -> EpisodeBatch | KeptEpisodes | None:
    """The trained groups (each with its group id and advantages, from `played`) as the replay buffer's `add` takes
    them: packed here (None: no episode), or, where the completions are kept on generator replicas, one part per kept
    batch of `played` naming its trained rows. A batch none of whose groups is trained is named with no rows, so that
    the buffer has its replica forget it at once rather than evict it later."""
    kept: dict[tuple[int, int], KeptPart] = {}
    for group in played:
        if isinstance(group, Group) and isinstance(group.samples, KeptGroup):
            k = group.samples
            kept.setdefault((id(k.generator), k.key), KeptPart(k.generator, k.key, [], [], [], [], []))
    if not kept:
        packed = [group.to_episodes(group_id, advantages) for group, group_id, advantages in trained]
        return EpisodeBatch.cat(packed) if packed else None
    for group, group_id, advantages in trained:
        k = group.samples
        part = kept[id(k.generator), k.key]
        part.rows += k.rows
        part.episode_ids += episode_ids(group_id, len(k.rows))
        part.group_ids += [group_id] * len(k.rows)
        part.rewards += group.rewards
        part.advantages += advantages
    return KeptEpisodes(list(kept.values()))


class Rollout(Protocol):
    """What plays a task's problems: `SingleTurn` or `MultiTurn`."""

    @property
    def reward_failures(self) -> int:
        """Reward calls that failed (scored 0), for the run's summary."""
        ...

    async def play_groups(self, problems: Sequence[TaskProblem], params: SamplingParams,
                          version: int = 0) -> list[Group | Exception]: ...


class Scorer(Protocol):
    """A single-turn rollout's rewards (apps/grpo/rewards.py's RewardScorer)."""

    failures: int

    async def score(self, texts: list[str], answer: str) -> list[float]: ...


async def _per_replica(generators: Any, problems: Sequence[TaskProblem],
                       play: Callable[[list], Awaitable[list[Group]]]) -> list[Group | Exception]:
    """`play(part)` for even parts of `problems`, one per healthy replica, concatenated in order. A part that fails
    (e.g. a prompt over the engine's window) is played again problem by problem, so that only the problems that fail
    alone get their error."""
    problems = list(problems)
    chunk = max(1, math.ceil(len(problems) / max(1, len(generators.healthy_replicas()))))
    parts = await asyncio.gather(*(_alone_on_failure(problems[i : i + chunk], play)
                                   for i in range(0, len(problems), chunk)))
    return [x for part in parts for x in part]


async def _alone_on_failure(part: list, play: Callable[[list], Awaitable[list[Group]]]) -> list[Group | Exception]:
    try:
        return list(await play(part))
    except FATAL:
        raise
    except Exception as e:
        if len(part) > 1:
            return [x for one in await asyncio.gather(*(_alone_on_failure([p], play) for p in part)) for x in one]
        print(f"generation failed for prompt {getattr(part[0], 'prompt', part[0])!r:.60}: {e}", file=sys.stderr)
        return [e]


class SingleTurn:
    """One completion per episode from the generator service, scored by `rewards` (None: unscored, `Group.rewards`
    empty; the caller scores `Group.samples.texts`). `keep_at_most`: the completions stay on their generator replica
    (`KeptGroup`), which keeps at most this many batches (a call's part is one): more than can be in flight per
    replica, since the oldest are evicted; None: they come back with their tensors (`CompletionBatch`)."""

    def __init__(self, generators: Any, rewards: Scorer | None = None, keep_at_most: int | None = None) -> None:
        if keep_at_most is not None and (not isinstance(keep_at_most, int) or keep_at_most < 1):
            raise ValueError(f"SingleTurn: keep_at_most={keep_at_most!r}: must be None or an int >= 1")
        self.generators, self.rewards, self.keep_at_most = generators, rewards, keep_at_most

    @property
    def reward_failures(self) -> int:
        return self.rewards.failures if self.rewards is not None else 0

    async def play_groups(self, problems: Sequence[TaskProblem], params: SamplingParams,
                          version: int = 0) -> list[Group | Exception]:
        async def play(part: list[TaskProblem]) -> list[Group]:
            prompts = [p.prompt for p in part]
            if self.keep_at_most is None:
                completions = await self.generators.generate_batch.route(prompts, params, min_policy_version=version)
                groups = [completions[i : i + 1] for i in range(len(part))]
            else:
                kept, generator = await self.generators.generate_kept.route_replica(
                    prompts, params, min_policy_version=version, keep_at_most=self.keep_at_most)
                starts = list(itertools.accumulate(kept.samples, initial=0))
                groups = [KeptGroup(generator, kept.key, range(a, b), kept.texts[a:b])
                          for a, b in zip(starts, starts[1:])]
            if self.rewards is None:
                return [Group(g, [], [False] * len(g.texts)) for g in groups]
            rewards = await asyncio.gather(*(self.rewards.score(g.texts, p.answer) for g, p in zip(groups, part)))
            return [Group(g, r, [False] * len(r)) for g, r in zip(groups, rewards)]

        return await _per_replica(self.generators, problems, play)


class MultiTurn:
    """Episodes against the task's environments (`player`), scored by them. With `params.seed`, copy j of a problem
    plays with seed `params.seed * params.n + j`: one seed for the n copies would play n equal episodes."""

    reward_failures = 0  # its environments score it

    def __init__(self, player: EpisodePlayer) -> None:
        self.player, self.generators = player, player.generators

    async def play_groups(self, problems: Sequence[TaskProblem], params: SamplingParams,
                          version: int = 0) -> list[Group | Exception]:
        async def play(part: list[TaskProblem]) -> list[Group]:
            n = params.n
            if params.seed is None:
                played = await self.player.play([p for p in part for _ in range(n)], params, version)
            else:  # copy by copy, each with its own seed; then problem by problem as above
                copies = [await self.player.play(part, replace(params, n=1, seed=params.seed * n + j), version)
                          for j in range(n)]
                played = [copies[j][i] for i in range(len(part)) for j in range(n)]
            groups = [played[i : i + n] for i in range(0, len(played), n)]
            return [Group(g, [t.reward for t in g], [t.failed for t in g]) for g in groups]

        return await _per_replica(self.generators, problems, play)
