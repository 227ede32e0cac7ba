"""A staleness-bounded replay buffer: the hand-off between rollout loops and the trainer.

`ReplayBuffer` is plain Python; `ReplayBufferActor` serves it on a proc mesh. Policy versions are those of `forge.types.Episode`
(one per generated token); an episode is as old as its oldest token.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from actors.replay_buffer_config import ReplayBufferConfig, check_int
from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric
from forge.types import Episode

__all__ = ["ReplayBuffer", "ReplayBufferActor", "ReplayBufferConfig"]

DROP_REASONS = ("too_old", "buffer_full")


@dataclass
class _Entry:
    episode: Episode
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
      episodes are trained before they age past the bound: an asynchronous job wastes no generation.
    - An episode leaves the buffer after it has been handed out `max_resample_count` times. That is
      normal use, not a loss: it is counted in `stats["consumed"]`, not among the drops.
    - Drops are counted by reason, never silently lost: "too_old" (past the age bound when `sample` or
      `evict` runs) and "buffer_full" (`add` went over `max_buffer_size`; the oldest episodes go first,
      by lowest `oldest_policy_version`, ties by insertion order). `on_drop(reason, count)` is called for
      each non-empty drop so the actor can forward counts to metrics.
    - Trainer versions never decrease: `sample` / `evict` with a version below the last one seen is an error.

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
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        try:  # the config's checks are the buffer's
            ReplayBufferConfig(batch_size=batch_size, max_policy_age=max_policy_age, dp_size=dp_size,
                               max_buffer_size=max_buffer_size, max_resample_count=max_resample_count, seed=seed,
                               sample_order=sample_order)
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
        self._on_drop = on_drop
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []  # kept in insertion order so sampling is reproducible
        self._next_seq = 0
        self._last_policy_version = 0
        self._counts = {"added": 0, "sampled": 0, "consumed": 0, **{f"dropped_{r}": 0 for r in DROP_REASONS}}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> dict[str, int]:
        """Counters since creation: added, sampled (hand-outs), consumed, held, dropped_<reason>."""
        return {**self._counts, "held": len(self._entries)}

    def add(self, episodes: list[Episode]) -> None:
        """Store episodes; if this overflows `max_buffer_size`, drop the oldest ("buffer_full")."""
        for episode in episodes:
            if not isinstance(episode, Episode):
                raise ValueError(f"ReplayBuffer.add: expected forge.types.Episode, got {type(episode).__name__}")
            if not episode.policy_versions:
                raise ValueError(
                    f"ReplayBuffer.add: episode_id={episode.episode_id} has policy_versions=[]: "
                    "an episode needs at least one generated token"
                )
        for episode in episodes:
            self._entries.append(_Entry(episode, self._next_seq))
            self._next_seq += 1
        self._counts["added"] += len(episodes)

        overflow = len(self._entries) - (self.max_buffer_size or len(self._entries))
        if overflow > 0:
            oldest = sorted(self._entries, key=lambda e: (e.episode.oldest_policy_version, e.seq))[:overflow]
            drop = {id(e) for e in oldest}
            self._entries = [e for e in self._entries if id(e) not in drop]
            self._count_drop("buffer_full", overflow)

    def evict(self, policy_version: int) -> int:
        """Drop the episodes too old to train the policy at `policy_version`; return how many."""
        self._check_version(policy_version)
        min_version = policy_version - self.max_policy_age
        kept = [e for e in self._entries if e.episode.oldest_policy_version >= min_version]
        dropped = len(self._entries) - len(kept)
        self._entries = kept
        self._count_drop("too_old", dropped)
        return dropped

    def sample(self, policy_version: int) -> list[list[Episode]] | None:
        """Evict, then return `dp_size` slices of `batch_size // dp_size` distinct episodes each.

        Returns None (and hands nothing out) when fewer than `batch_size` usable episodes are held.
        """
        self.evict(policy_version)
        if len(self._entries) < self.batch_size:
            return None
        if self.sample_order == "random":
            picked = self._rng.sample(range(len(self._entries)), self.batch_size)
        else:
            by_age = sorted(range(len(self._entries)),
                            key=lambda i: (self._entries[i].episode.oldest_policy_version, self._entries[i].seq))
            picked = by_age[: self.batch_size]
        batch = []
        for index in picked:
            entry = self._entries[index]
            entry.times_sampled += 1
            batch.append(entry.episode)
        consumed = {index for index in picked if self._entries[index].times_sampled >= self.max_resample_count}
        self._entries = [e for i, e in enumerate(self._entries) if i not in consumed]
        self._counts["sampled"] += self.batch_size
        self._counts["consumed"] += len(consumed)
        per_rank = self.batch_size // self.dp_size
        return [batch[rank * per_rank : (rank + 1) * per_rank] for rank in range(self.dp_size)]

    def state_dict(self) -> dict:
        """Plain Python values only (episodes as dicts), so `torch.save(..., weights_only=True)` works."""
        return {
            "entries": [
                {"episode": dataclasses.asdict(e.episode), "seq": e.seq, "times_sampled": e.times_sampled}
                for e in self._entries
            ],
            "next_seq": self._next_seq,
            "last_policy_version": self._last_policy_version,
            "counts": dict(self._counts),
            "rng_state": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore held episodes, counters and RNG state; the configuration stays this buffer's own."""
        missing = {"entries", "next_seq", "last_policy_version", "counts", "rng_state"} - state.keys()
        if missing:
            raise ValueError(f"ReplayBuffer.load_state_dict: state is missing keys {sorted(missing)}")
        self._entries = [
            _Entry(Episode(**e["episode"]), seq=e["seq"], times_sampled=e["times_sampled"]) for e in state["entries"]
        ]
        self._next_seq = state["next_seq"]
        self._last_policy_version = state["last_policy_version"]
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

    def _count_drop(self, reason: str, count: int) -> None:
        if count == 0:
            return
        self._counts[f"dropped_{reason}"] += count
        if self._on_drop is not None:
            self._on_drop(reason, count)


class ReplayBufferActor(ForgeActor):
    """The replay buffer as an actor: rollout loops `add`, the training loop `sample`s."""

    def __init__(self, config: ReplayBufferConfig | dict | None = None, **overrides) -> None:
        if isinstance(config, dict) or config is None:
            config = ReplayBufferConfig(**{**(config or {}), **overrides})
        self.buffer = ReplayBuffer(**asdict(config), on_drop=self._on_drop)

    def _on_drop(self, reason: str, count: int) -> None:
        record_metric(f"buffer/dropped_{reason}", count, "sum")

    @endpoint
    async def add(self, episodes: list[Episode]) -> int:
        self.buffer.add(episodes)
        record_metric("buffer/size", len(self.buffer), "max")
        return len(self.buffer)

    @endpoint
    async def sample(self, policy_version: int) -> list[list[Episode]] | None:
        batch = self.buffer.sample(policy_version)
        if batch is not None:
            ages = [policy_version - e.oldest_policy_version for shard in batch for e in shard]
            record_metric("buffer/sampled_age_mean", sum(ages) / len(ages))
            record_metric("buffer/sampled_age_max", max(ages), "max")
        return batch

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
