"""A staleness-bounded replay buffer: the hand-off between rollout loops and the trainer.

`ReplayBuffer` is plain Python; `ReplayBufferActor` serves it on a proc mesh. Policy versions are those of `rl.types.Episode`
(one per generated token); an episode is as old as its oldest token.

The buffer also decides how much rollout work may be under way (`reserve`): it counts what it holds and what rollouts
have reserved but not yet delivered, so nothing is generated that would be too old to train when it arrives.

The actor is where episodes and batches meet other actors without the job's controller: `add` takes the episodes
of a single-turn rollout from the generator replicas that keep them (`KeptEpisodes`: the controller names the rows
and their rewards and advantages) and has the scorer (the reference model or the teacher) score what it adds, and the
trainer's ranks fetch the batch `next_batch` sampled (`batch`), so the controller moves only handles, versions, texts
and counts (apps/grpo/scheduler.py drives both).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from actors.replay_buffer_config import ReplayBufferConfig, check_int
from forge.actor import ForgeActor, endpoint, rank0
from forge.metrics import record_metric
from rl.types import Episode, EpisodeBatch, KeptEpisodes, KeptPart, TrainBatch

__all__ = ["Added", "HandedBatch", "ReplayBuffer", "ReplayBufferActor", "ReplayBufferConfig"]

DROP_REASONS = ("too_old", "buffer_full")
# How long `add` waits for a generator replica to hand over the episodes it keeps: a replica that died answers with a
# supervision error after a while, one whose process hangs never would.
TAKE_TIMEOUT_S = 60.0


@dataclass
class _Entry:
    batch: EpisodeBatch  # the packed batch the episode arrived in (held until all its episodes have left)
    row: int  # the episode's row in it
    oldest_policy_version: int
    seq: int  # insertion order, breaks ties between episodes of the same version
    times_sampled: int = 0


class ReplayBuffer:
    """Holds scored episodes and hands the trainer batches no older than `max_policy_age` versions.

    Semantics:
    - `sample(v)` never returns an episode whose oldest token came from a version older than
      `v - max_policy_age`; `max_policy_age=0` is strictly on-policy.
    - Episodes in one batch are distinct. `sample_order="random"`: chosen uniformly at random with a seeded
      RNG (the same seed and calls give the same batches, also across `state_dict` / `load_state_dict`).
      `"oldest"`: the oldest usable episodes first (by `oldest_policy_version`, then insertion order), so
      episodes are trained before they age past the bound: an asynchronous job wastes no generation. With
      `shuffle_batch` those episodes come in a seeded random order, so the trainer's minibatches (contiguous row
      slices) each mix all the batch's groups instead of holding a few whole groups.
    - An episode leaves the buffer after it has been handed out `max_resample_count` times. That is
      normal use, not a loss: it is counted in `stats["consumed"]`, not among the drops.
    - Drops are counted by reason, never silently lost: "too_old" (past the age bound when `sample` runs) and "buffer_full" (`add` went over `max_buffer_size`; the oldest episodes go first,
      by lowest `oldest_policy_version`, ties by insertion order). `on_drop(reason, count)` is called for
      each non-empty drop so the actor can forward counts to metrics.
    - Trainer versions never decrease: `sample` with a version below the last one seen is an error.

    Rollout capacity (`reserve` / `add(..., reserved=n)`): a rollout about to generate episodes with policy version v
    reserves room for them first, and settles the reservation when it delivers them (fewer when some were dropped on
    the way: the rest of the room is released). An episode made by version v can be trained by the batches
    the trainer samples at versions up to v + max_policy_age; the buffer assumes one batch per trainer version, so
    the batches still to come are those sampled at `next_batch_version` (the last version sampled, plus one once a
    batch went out at it) up to v + max_policy_age (and no later than the last batch of the job, when known). Room is
    those batches' episodes minus what is held and what is reserved and not yet delivered (`in_flight`), capped by
    `max_buffer_size`. A group is granted while any room is left for the batches (not only room for a whole group): a
    group delivered short (episodes dropped for their environment) leaves less than a group's room, and the job's last
    batch must still fill. So at `max_policy_age=0` rollouts wait while the trainer trains on version v's batch, until
    v + 1 is published, and no reserved episode is ever dropped as too old. At larger ages none is either with
    `sample_order="oldest"` when episodes arrive in the order they were reserved; with "random" an episode can still
    be left behind until it ages out.

    Invariant: `added == held + consumed + dropped_too_old + dropped_buffer_full`.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        max_policy_age: int,
        max_buffer_size: int | None = None,
        max_resample_count: int = 1,
        seed: int = 0,
        sample_order: str = "random",
        shuffle_batch: bool = False,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        try:  # the config's checks are the buffer's
            ReplayBufferConfig(batch_size=batch_size, max_policy_age=max_policy_age,
                               max_buffer_size=max_buffer_size, max_resample_count=max_resample_count, seed=seed,
                               sample_order=sample_order, shuffle_batch=shuffle_batch)
        except ValueError as e:
            raise ValueError(f"ReplayBuffer.{e}") from None
        if on_drop is not None and not callable(on_drop):
            raise ValueError(f"ReplayBuffer.on_drop={on_drop!r}: must be None or a callable(reason, count)")

        self.batch_size = batch_size
        self.max_policy_age = max_policy_age
        self.max_buffer_size = max_buffer_size
        self.max_resample_count = max_resample_count
        self.sample_order = sample_order
        self.shuffle_batch = shuffle_batch
        self._on_drop = on_drop
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []  # kept in insertion order so sampling is reproducible
        self._next_seq = 0
        self._last_policy_version = 0
        self._next_batch_version = 0  # the trainer version the next batch will be sampled at
        self._in_flight = 0  # episodes reserved by rollouts, not yet added or released
        self._counts = {"added": 0, "sampled": 0, "consumed": 0, **{f"dropped_{r}": 0 for r in DROP_REASONS}}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> dict[str, int]:
        """Counters since creation: added, sampled (hand-outs), consumed, held, dropped_<reason>."""
        return {**self._counts, "held": len(self._entries)}

    @property
    def in_flight(self) -> int:
        """Episodes reserved by rollouts (`reserve`) and neither added nor released yet."""
        return self._in_flight

    def reserve(self, policy_version: int, groups: int, group_size: int = 1, last_version: int | None = None) -> int:
        """Reserve room for up to `groups` groups of `group_size` episodes about to be generated with `policy_version`;
        return how many groups were granted (0 when there is no room: wait for a batch to be sampled, for a newer
        version, or for a `release`). `last_version`: the trainer version of the job's last batch, when known, so
        that nothing is generated that only a later batch could train."""
        check_int("ReplayBuffer.reserve: policy_version", policy_version, 0, "an int >= 0")
        check_int("ReplayBuffer.reserve: groups", groups, 0, "an int >= 0")
        check_int("ReplayBuffer.reserve: group_size", group_size, 1, "an int >= 1")
        if last_version is not None:
            check_int("ReplayBuffer.reserve: last_version", last_version, 0, "None or an int >= 0")
        newest_batch = policy_version + self.max_policy_age  # the last batch that can still train these episodes
        if last_version is not None:
            newest_batch = min(newest_batch, last_version)
        batches = max(0, newest_batch - self._next_batch_version + 1)
        taken = len(self._entries) + self._in_flight
        room = batches * self.batch_size - taken
        granted = -(-room // group_size)  # while any room is left (the class docstring says why)
        if self.max_buffer_size is not None:
            granted = min(granted, (self.max_buffer_size - taken) // group_size)  # whole groups within the bound
        granted = max(0, min(groups, granted))
        self._in_flight += granted * group_size
        return granted

    def add(self, episodes: Sequence[Episode] | EpisodeBatch, reserved: int = 0) -> None:
        """Store episodes (held packed, as they arrive from rollouts); if this overflows `max_buffer_size`, drop the
        oldest ("buffer_full").

        `reserved=n`: the episodes settle n episodes reserved by `reserve` (they leave `in_flight`); those of the n that
        did not come (a failed generation, a group or episodes dropped on the way) are released. `episodes` may then
        be empty."""
        check_int("ReplayBuffer.add: reserved", reserved, 0, "an int >= 0")
        if reserved and not len(episodes) <= reserved <= self._in_flight:
            raise ValueError(f"ReplayBuffer.add: reserved={reserved} for {len(episodes)} episodes: must be from "
                             f"{len(episodes)} to in_flight={self._in_flight} (the episodes reserved, not yet added "
                             "or released)")
        if not isinstance(episodes, EpisodeBatch):
            for episode in episodes:
                if not isinstance(episode, Episode):
                    raise ValueError(f"ReplayBuffer.add: expected rl.types.Episode, got {type(episode).__name__}")
            episodes = EpisodeBatch.pack(episodes)
        empty = (episodes.completion_lengths == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"ReplayBuffer.add: episode_id={int(episodes.episode_ids[empty[0]])} has policy_versions=[]: "
                "an episode needs at least one generated token"
            )
        self._in_flight -= reserved
        for row, oldest in enumerate(episodes.oldest_policy_versions().tolist()):
            self._entries.append(_Entry(episodes, row, oldest, self._next_seq))
            self._next_seq += 1
        self._counts["added"] += len(episodes)

        overflow = len(self._entries) - (self.max_buffer_size or len(self._entries))
        if overflow > 0:
            oldest = sorted(self._entries, key=lambda e: (e.oldest_policy_version, e.seq))[:overflow]
            drop = {id(e) for e in oldest}
            self._entries = [e for e in self._entries if id(e) not in drop]
            self._count_drop("buffer_full", overflow)

    def sample(self, policy_version: int) -> EpisodeBatch | None:
        """Drop what is too old to train `policy_version`, then return `batch_size` distinct episodes in one packed batch
        (each data-parallel rank of the trainer takes its contiguous rows). Returns None (and hands nothing out) when
        fewer than `batch_size` usable episodes are held."""
        self._evict(policy_version)
        if len(self._entries) < self.batch_size:
            return None
        if self.sample_order == "random":
            picked = self._rng.sample(range(len(self._entries)), self.batch_size)
        else:
            by_age = sorted(range(len(self._entries)),
                            key=lambda i: (self._entries[i].oldest_policy_version, self._entries[i].seq))
            picked = by_age[: self.batch_size]
            if self.shuffle_batch:  # which episodes stays by age; their order mixes the groups across minibatches
                self._rng.shuffle(picked)
        for index in picked:
            self._entries[index].times_sampled += 1
        batch = _gather_rows([self._entries[index] for index in picked])
        consumed = {index for index in picked if self._entries[index].times_sampled >= self.max_resample_count}
        self._entries = [e for i, e in enumerate(self._entries) if i not in consumed]
        self._counts["sampled"] += self.batch_size
        self._counts["consumed"] += len(consumed)
        self._next_batch_version = policy_version + 1  # one batch per trainer version
        return batch

    def _evict(self, policy_version: int) -> None:
        self._check_version(policy_version)
        min_version = policy_version - self.max_policy_age
        kept = [e for e in self._entries if e.oldest_policy_version >= min_version]
        self._count_drop("too_old", len(self._entries) - len(kept))
        self._entries = kept

    def state_dict(self) -> dict:
        """Plain Python values only (episodes as dicts), so `torch.save(..., weights_only=True)` works."""
        return {
            "entries": [
                {"episode": dataclasses.asdict(episode), "seq": e.seq, "times_sampled": e.times_sampled}
                for e, episode in zip(self._entries, _gather_rows(self._entries).unpack() if self._entries else [])
            ],
            "next_seq": self._next_seq,
            "last_policy_version": self._last_policy_version,
            "next_batch_version": self._next_batch_version,
            "counts": dict(self._counts),
            "rng_state": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore held episodes, counters and RNG state; the configuration stays this buffer's own. Reservations
        are not part of the state: they belong to the rollouts of the job that made them."""
        keys = {"entries", "next_seq", "last_policy_version", "next_batch_version", "counts", "rng_state"}
        missing = keys - state.keys()
        if missing:
            raise ValueError(f"ReplayBuffer.load_state_dict: state is missing keys {sorted(missing)}")
        held = EpisodeBatch.pack([Episode(**e["episode"]) for e in state["entries"]])
        self._entries = [
            _Entry(held, row, oldest, seq=e["seq"], times_sampled=e["times_sampled"])
            for row, (e, oldest) in enumerate(zip(state["entries"], held.oldest_policy_versions().tolist()))
        ]
        self._next_seq = state["next_seq"]
        self._last_policy_version = state["last_policy_version"]
        self._next_batch_version = state["next_batch_version"]
        self._counts = dict(state["counts"])
        version, internal, gauss_next = state["rng_state"]
        # A round trip through some serializers turns the tuples into lists; setstate needs tuples.
        self._rng.setstate((version, tuple(internal), gauss_next))

    def _check_version(self, policy_version: int) -> None:
        check_int("ReplayBuffer.policy_version", policy_version, 0, "an int >= 0")
        if policy_version < self._last_policy_version:
            raise ValueError(
                f"ReplayBuffer: policy_version={policy_version} is below the last one seen "
                f"({self._last_policy_version}); trainer versions never decrease"
            )
        self._last_policy_version = policy_version
        self._next_batch_version = max(self._next_batch_version, policy_version)

    def _count_drop(self, reason: str, count: int) -> None:
        if count == 0:
            return
        self._counts[f"dropped_{reason}"] += count
        if self._on_drop is not None:
            self._on_drop(reason, count)


def _gather_rows(entries: list[_Entry]) -> EpisodeBatch:
    """The entries' episodes in one batch, in order: one `select` per packed batch they came in, not one per row."""
    by_batch: dict[int, tuple[EpisodeBatch, list[int], list[int]]] = {}
    for position, entry in enumerate(entries):
        _, rows, positions = by_batch.setdefault(id(entry.batch), (entry.batch, [], []))
        rows.append(entry.row)
        positions.append(position)
    parts = list(by_batch.values())
    joined = EpisodeBatch.cat([batch.select(rows) for batch, rows, _ in parts])
    order = torch.empty(len(entries), dtype=torch.long)
    order[torch.tensor([p for _, _, positions in parts for p in positions])] = torch.arange(len(entries))
    return joined.select(order)


@dataclass(frozen=True)
class HandedBatch:
    """What the job's controller learns of a batch the buffer handed out: a few numbers, not its tensors (the trainer
    fetches those from the buffer actor: `ReplayBufferActor.batch`)."""

    policy_version: int  # the version it was sampled for: the trainer asks for it by this
    episodes: int
    reward_mean: float
    version_lag_mean: float  # policy_version minus each episode's oldest token's version, averaged
    stats: dict[str, int]  # the buffer's counters once it was sampled (ReplayBuffer.stats)


async def score_episodes(episodes: EpisodeBatch, scorer: Any, pad_id: int, top_k: int = 0) -> None:
    """Set the episodes' `ref_logprobs` from `scorer` (the reference model or the distillation teacher); with `top_k`
    > 0 also the teacher's top-k at every position (`ref_topk_ids`, `ref_topk_logprobs`), from the same forward pass."""
    if top_k > 0:
        episodes.ref_logprobs, episodes.ref_topk_ids, episodes.ref_topk_logprobs = rank0(
            await scorer.topk_logprobs.call(episodes, pad_id, top_k))
    else:
        episodes.ref_logprobs = rank0(await scorer.logprobs.call(episodes, pad_id))


@dataclass(frozen=True)
class Added:
    """What `ReplayBufferActor.add` did: the episodes held after it, and those it could not take from the generator
    replica that kept them (it died or evicted them in between), which its caller counts as failed generations."""

    held: int
    lost_episodes: int = 0
    lost_groups: int = 0


class ReplayBufferActor(ForgeActor):
    """The replay buffer as an actor: rollouts `reserve` room and `add` (scored on the way by the scorer they name), the
    training loop has a batch sampled (`next_batch`) and the trainer's ranks fetch it (`batch`)."""

    def __init__(self, config: ReplayBufferConfig | dict | None = None, **overrides) -> None:
        torch.set_num_threads(1)  # its tensor work is gathers and scatters: extra threads only spin-wait (OpenMP)
        if isinstance(config, dict) or config is None:
            config = ReplayBufferConfig(**{**(config or {}), **overrides})
        self.buffer = ReplayBuffer(**asdict(config), on_drop=self._on_drop)
        self.handed: tuple[int, TrainBatch] | None = None  # the last batch sampled, until the next one

    def _on_drop(self, reason: str, count: int) -> None:
        record_metric(f"buffer/dropped_{reason}", count, "sum")

    @endpoint
    async def reserve(self, policy_version: int, groups: int, group_size: int = 1,
                      last_version: int | None = None) -> int:
        granted = self.buffer.reserve(policy_version, groups, group_size, last_version)
        record_metric("buffer/in_flight", self.buffer.in_flight, "max")
        return granted

    @endpoint
    async def add(self, episodes: EpisodeBatch | KeptEpisodes | None, reserved: int = 0, scorer: Any = None,
                  pad_id: int = 0, top_k: int = 0) -> Added:
        """Store a packed batch of episodes (see `ReplayBuffer.add`); None: none came for the `reserved` room.
        `KeptEpisodes`: episodes whose tensors generator replicas keep, taken from them here (the rows named, each
        kept batch forgotten there), so they never pass through the caller; those of a replica that cannot hand
        them over are lost (`Added`), their room released. `scorer`: an actor whose `logprobs(episodes, pad_id)`
        gives their `ref_logprobs` (the reference model or the distillation teacher), asked here for the same reason;
        with `top_k` > 0 its `topk_logprobs(episodes, pad_id, top_k)` gives `ref_topk_ids` and `ref_topk_logprobs`
        too (the teacher's top-k at every position: losses.distill's kl="reverse" / "forward")."""
        if not isinstance(episodes, (EpisodeBatch, KeptEpisodes)) and not (episodes is None and reserved):
            raise ValueError(f"ReplayBufferActor.add: episodes must be a rl.types.EpisodeBatch "
                             f"(EpisodeBatch.pack(episodes)) or KeptEpisodes, or None with reserved > 0; got "
                             f"{type(episodes).__name__}")
        lost_episodes = lost_groups = 0
        if isinstance(episodes, KeptEpisodes):
            taken = await asyncio.gather(*(self._take(part) for part in episodes.parts))
            for part, batch in zip(episodes.parts, taken):
                if batch is None and part.rows:
                    lost_episodes += len(part.rows)
                    lost_groups += len(set(part.group_ids))
            got = [batch for batch in taken if batch is not None]
            episodes = EpisodeBatch.cat(got) if got else None
        if scorer is not None and episodes is not None:
            await score_episodes(episodes, scorer, pad_id, top_k)
        self.buffer.add(episodes if episodes is not None else [], reserved)
        record_metric("buffer/size", len(self.buffer), "max")
        return Added(len(self.buffer), lost_episodes, lost_groups)

    async def _take(self, part: KeptPart) -> EpisodeBatch | None:
        """The part's rows from the replica that keeps them, with the ids, rewards and advantages the caller gave
        them; None when it names no rows or the replica cannot hand them over (said on stderr: a replica's death
        costs its groups, as a failed generation does, not the job)."""
        try:
            taken = rank0(await asyncio.wait_for(part.generator.take_kept.call(part.key, part.rows), TAKE_TIMEOUT_S))
        except Exception as e:
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            print(f"replay buffer: kept batch {part.key} lost ({len(part.rows)} episodes): {type(e).__name__}: "
                  f"{first}", file=sys.stderr, flush=True)
            return None
        if taken is None:
            return None
        taken.episode_ids = torch.tensor(part.episode_ids, dtype=torch.long)
        taken.group_ids = torch.tensor(part.group_ids, dtype=torch.long)
        taken.rewards = torch.tensor(part.rewards, dtype=torch.float32)
        taken.advantages = torch.tensor(part.advantages, dtype=torch.float32)
        return taken

    @endpoint
    async def next_batch(self, policy_version: int, pad_id: int) -> HandedBatch | None:
        """Sample the batch to train `policy_version` and keep it, as padded tensors, for the trainer's ranks to fetch
        (`batch`); return what the caller needs to know of it (None: not enough usable episodes yet)."""
        episodes = self.buffer.sample(policy_version)  # the ranks' shards are contiguous rows
        if episodes is None:
            return None
        batch = TrainBatch.from_episodes(episodes, pad_id)
        self.handed = (policy_version, batch)
        ages = (policy_version - episodes.oldest_policy_versions()).double()
        record_metric("buffer/sampled_age_mean", float(ages.mean()))
        record_metric("buffer/sampled_age_max", float(ages.max()), "max")
        return HandedBatch(policy_version, batch.num_sequences, float(batch.rewards.mean()), float(ages.mean()),
                           self.buffer.stats)

    @endpoint
    async def batch(self, policy_version: int) -> TrainBatch:
        """The batch `next_batch` sampled for `policy_version` (every trainer rank fetches the same one)."""
        if self.handed is None or self.handed[0] != policy_version:
            sampled = "none" if self.handed is None else f"policy_version={self.handed[0]}"
            raise ValueError(f"ReplayBufferActor.batch: policy_version={policy_version} has no batch sampled "
                             f"(the last one sampled: {sampled}); call next_batch first")
        return self.handed[1]

    @endpoint
    async def stats(self) -> dict[str, int]:
        return self.buffer.stats

    @endpoint
    async def state_dict(self) -> dict:
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)
