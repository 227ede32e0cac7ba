"""Whether the weight store publishes only what changed (forge/weights/delta.py, forge/weights/store.py): the setting,
torch-free so that config checks can read it before anything is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeltaSync:
    """Publishing only what changed (forge/weights/delta.py): each tensor of a version is stored as its delta from the
    previous version where that is smaller, whole else; readers rebuild it on their own copy of the previous version
    (one copy of the weights in each reader's host memory, and one in the publisher's)."""

    enabled: bool = False
    """Compare each published tensor with the previous version's and store only what changed where that is smaller."""
    full_every: int = 8
    """A version of full tensors at least every this many versions: bounds what a reader that has none of a chain
    reads (its full version and the deltas after it), and what the store keeps (a chain's versions stay until a
    newer chain is kept)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled={self.enabled!r}: must be true or false")
        if not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"full_every={self.full_every!r}: must be an int >= 1 (1: every version full)")
