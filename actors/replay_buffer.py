"""A staleness-bounded replay buffer: the hand-off between rollout loops and the trainer.

`ReplayBuffer` is plain Python; `ReplayBufferActor` serves it on a proc mesh. Policy versions are those of `rl.types.Episode`
(one per generated token); an episode is as old as its oldest token.

The buffer also decides how much rollout work may be under way (`reserve`): it counts what it holds and what rollouts
have reserved but not yet delivered, so nothing is generated that would be too old to train when it arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from actors.replay_buffer_config import ReplayBufferConfig, check_int
from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric
from rl.types import Episode, EpisodeBatch, TrainBatch

__all__ = ["ReplayBuffer", "ReplayBufferActor", "ReplayBufferClient", "ReplayBufferConfig"]

DROP_REASONS = ("too_old", "buffer_full")


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
    - Drops are counted by reason, never silently lost: "too_old" (past the age bound when `sample` or
      `evict` runs) and "buffer_full" (`add` went over `max_buffer_size`; the oldest episodes go first,
      by lowest `oldest_policy_version`, ties by insertion order). `on_drop(reason, count)` is called for
      each non-empty drop so the actor can forward counts to metrics.
    - Trainer versions never decrease: `sample` / `evict` with a version below the last one seen is an error.

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
        dp_size: int = 1,
        max_buffer_size: int | None = None,
        max_resample_count: int = 1,
        seed: int = 0,
        sample_order: str = "random",
        shuffle_batch: bool = False,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        try:  # the config's checks are the buffer's
            ReplayBufferConfig(batch_size=batch_size, max_policy_age=max_policy_age, dp_size=dp_size,
                               max_buffer_size=max_buffer_size, max_resample_count=max_resample_count, seed=seed,
                               sample_order=sample_order, shuffle_batch=shuffle_batch)
        except ValueError as e:
            raise ValueError(f"ReplayBuffer.{e}") from None
        if on_drop is not None and not callable(on_drop):
            raise ValueError(f"ReplayBuffer.on_drop={on_drop!r}: must be None or a callable(reason, count)")

        self.batch_size = batch_size
        self.max_policy_age = max_policy_age
        self.dp_size = dp_size
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

    def evict(self, policy_version: int) -> int:
        """Drop the episodes too old to train the policy at `policy_version`; return how many."""
        self._check_version(policy_version)
        min_version = policy_version - self.max_policy_age
        kept = [e for e in self._entries if e.oldest_policy_version >= min_version]
        dropped = len(self._entries) - len(kept)
        self._entries = kept
        self._count_drop("too_old", dropped)
        return dropped

    def sample(self, policy_version: int) -> list[list[Episode]] | None:
        """Evict, then return `dp_size` slices of `batch_size // dp_size` distinct episodes each.

        Returns None (and hands nothing out) when fewer than `batch_size` usable episodes are held.
        """
        batch = self.sample_batch(policy_version)
        if batch is None:
            return None
        episodes, per_rank = batch.unpack(), self.batch_size // self.dp_size
        return [episodes[rank * per_rank : (rank + 1) * per_rank] for rank in range(self.dp_size)]

    def sample_batch(self, policy_version: int) -> EpisodeBatch | None:
        """`sample`, packed: its slices one after another in one EpisodeBatch (each rank takes its contiguous rows)."""
        self.evict(policy_version)
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


class ReplayBufferActor(ForgeActor):
    """The replay buffer as an actor: rollouts `reserve` room and `add`, the training loop `sample`s (through a
    `ReplayBufferClient` in a job's controller)."""

    def __init__(self, config: ReplayBufferConfig | dict | None = None, **overrides) -> None:
        torch.set_num_threads(1)  # its tensor work is gathers and scatters: extra threads only spin-wait (OpenMP)
        if isinstance(config, dict) or config is None:
            config = ReplayBufferConfig(**{**(config or {}), **overrides})
        self.buffer = ReplayBuffer(**asdict(config), on_drop=self._on_drop)

    def _on_drop(self, reason: str, count: int) -> None:
        record_metric(f"buffer/dropped_{reason}", count, "sum")

    @endpoint
    async def reserve(self, policy_version: int, groups: int, group_size: int = 1,
                      last_version: int | None = None) -> int:
        granted = self.buffer.reserve(policy_version, groups, group_size, last_version)
        record_metric("buffer/in_flight", self.buffer.in_flight, "max")
        return granted

    @endpoint
    async def add(self, episodes: EpisodeBatch | None, reserved: int = 0) -> int:
        """Store a packed batch of episodes (see `ReplayBuffer.add`); None: none came for the `reserved` room."""
        if not isinstance(episodes, EpisodeBatch) and not (episodes is None and reserved):
            raise ValueError(f"ReplayBufferActor.add: episodes must be a rl.types.EpisodeBatch "
                             f"(EpisodeBatch.pack(episodes)), or None with reserved > 0; got {type(episodes).__name__}")
        self.buffer.add(episodes if episodes is not None else [], reserved)
        record_metric("buffer/size", len(self.buffer), "max")
        return len(self.buffer)

    @endpoint
    async def sample(self, policy_version: int, pad_id: int) -> TrainBatch | None:
        """The next batch for `policy_version` as padded tensors (None: not enough usable episodes yet). The
        episodes leave the buffer as a few tensors, not as Python lists per episode, so the controller that passes
        them on to the trainer pickles and unpickles a handful of buffers per step."""
        episodes = self.buffer.sample_batch(policy_version)  # the ranks' shards are contiguous rows
        if episodes is None:
            return None
        ages = (policy_version - episodes.oldest_policy_versions()).double()
        record_metric("buffer/sampled_age_mean", float(ages.mean()))
        record_metric("buffer/sampled_age_max", float(ages.max()), "max")
        return TrainBatch.from_episodes(episodes, pad_id)

    @endpoint
    async def evict(self, policy_version: int) -> int:
        return self.buffer.evict(policy_version)

    @endpoint
    async def stats(self) -> dict[str, int]:
        return self.buffer.stats

    @endpoint
    async def state_dict(self) -> dict:
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)


class ReplayBufferClient:
    """A job controller's side of the buffer actor, where rollouts and training meet: the rollout side starts groups as
    far as the buffer grants room for them (`fill`), the training side waits for a batch (`next_batch`), and each wakes
    the other when it may have changed what the other waits for. Group sizes, the concurrency bound and the newest
    policy version (`published`) live here, so a job's loops only say what to generate and what to train."""

    def __init__(self, actor: Any, *, pad_id: int, group_size: int, max_groups_in_flight: int) -> None:
        self.actor, self.pad_id, self.group_size = actor, pad_id, group_size
        self.max_groups_in_flight, self.groups_in_flight = max_groups_in_flight, 0
        self.version = self.last_version = 0  # the newest published policy version; the job's last batch's version
        self.stopped = False
        # Each has one waiter, which clears it before it looks: whatever happens after that sets it again.
        self._room, self._arrived = asyncio.Event(), asyncio.Event()

    def published(self, version: int, steps_left: int) -> None:
        """Policy `version` is published: groups start with it from now on; `steps_left`: the batches the job still
        trains (nothing is generated that only a later batch could train)."""
        self.version, self.last_version = version, version + steps_left - 1
        self._room.set()

    def stop(self) -> None:
        """`fill` and `next_batch` return at once, now and from now on."""
        self.stopped = True
        self._room.set()
        self._arrived.set()

    async def run(self, make_groups: Callable[[int, int], Awaitable[None]], training: Awaitable[None]) -> None:
        """`training` (which drains the buffer with `next_batch`) while `fill(make_groups)` fills it, until `training`
        ends; a `make_groups` that fails ends both with its error. `fill` ends first only when stopped: the training
        step in progress then finishes."""
        rollouts, training = asyncio.ensure_future(self.fill(make_groups)), asyncio.ensure_future(training)
        try:
            done, _ = await asyncio.wait([training, rollouts], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            await training
        finally:
            self.stop()
            for task in [training, rollouts]:
                task.cancel()
            await asyncio.gather(training, rollouts, return_exceptions=True)

    async def fill(self, make_groups: Callable[[int, int], Awaitable[None]]) -> None:
        """Until `stop`: whenever the buffer grants room (`ReplayBuffer.reserve`) for prompt groups with the newest
        version, within `max_groups_in_flight`, start `make_groups(count, version)`, which must end with `add`. A
        `make_groups` that fails ends this with its error."""
        running: set[asyncio.Future] = set()
        try:
            while not self.stopped:
                self._room.clear()
                for task in [t for t in running if t.done()]:
                    running.discard(task)
                    task.result()
                wanted, version = self.max_groups_in_flight - self.groups_in_flight, self.version
                granted = wanted and await self.actor.reserve.call_one(version, wanted, self.group_size,
                                                                       self.last_version)
                if granted:
                    self.groups_in_flight += granted
                    task = asyncio.ensure_future(make_groups(granted, version))
                    task.add_done_callback(lambda _: self._room.set())
                    running.add(task)
                else:
                    await self._room.wait()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def add(self, episodes: EpisodeBatch | None, groups: int) -> None:
        """Deliver the episodes made for `groups` granted groups (fewer, or None, when groups or episodes were dropped
        on the way: the rest of their room is released), in one call."""
        await self.actor.add.call_one(episodes, reserved=groups * self.group_size)
        self.groups_in_flight -= groups
        self._arrived.set()
        self._room.set()

    async def next_batch(self) -> TrainBatch | None:
        """The next batch for the newest version, once the buffer holds one; None once stopped."""
        while not self.stopped:
            self._arrived.clear()
            batch = await self.actor.sample.call_one(self.version, self.pad_id)
            self._room.set()  # a batch handed out, or stale episodes evicted: rollouts may have room
            if batch is not None:
                return batch
            await self._arrived.wait()
        return None
