"""The replay buffer's settings and their checks, in plain Python: no torch, no Monarch.

A job's config is checked before its training stack is imported (apps/grpo/cli.py), so the config schema must not
pull that stack in; `actors.replay_buffer` (the buffer and its actor) builds on this module.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_ORDERS = ("random", "oldest")


@dataclass
class ReplayBufferConfig:
    """The buffer between the rollouts and the trainer, and its staleness bound."""

    batch_size: int = 16
    """Episodes per training step (in apps.grpo a multiple of `rollout.group_size`, divisible by
    `resources.trainer_procs`)."""
    max_policy_age: int = 1
    """0: synchronous, strictly on-policy; k: generation may run k policy versions ahead of training."""
    max_buffer_size: int | None = None
    """Episodes held at most (null: no bound; else at least `batch_size`)."""
    max_resample_count: int = 1
    """How many times one episode may be sampled."""
    seed: int = 0
    """Seed of the random sample order."""
    sample_order: str = "random"
    """`random` (seeded) or `oldest` (oldest usable episodes first, so none ages out while held; the shipped GRPO
    configs)."""
    shuffle_batch: bool = False
    """With `sample_order: oldest`: hand the chosen episodes out in a seeded random order, so each of the trainer's
    `minibatches` (contiguous slices of the batch) holds part of every group rather than a few whole groups, as TRL
    shuffles a generation batch before splitting it into optimizer steps (`random` order mixes them already)."""

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, "an int >= 1")
        check_int("max_policy_age", self.max_policy_age, 0, "an int >= 0 (0 = strictly on-policy)")
        if self.max_buffer_size is not None:
            # Fewer slots than a batch would make every sample() return None.
            check_int("max_buffer_size", self.max_buffer_size, self.batch_size,
                      f"None or an int >= batch_size={self.batch_size}")
        check_int("max_resample_count", self.max_resample_count, 1, "an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be an int")
        if not isinstance(self.shuffle_batch, bool):
            raise ValueError(f"shuffle_batch={self.shuffle_batch!r}: must be true or false")
        if self.sample_order not in SAMPLE_ORDERS:
            raise ValueError(f"sample_order={self.sample_order!r}: must be one of {', '.join(SAMPLE_ORDERS)}")


def check_int(name: str, value: object, minimum: int, allowed: str) -> None:
    # bool is an int subclass; `batch_size=True` is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be {allowed}")
