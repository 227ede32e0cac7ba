"""What a published policy version is: its manifest (each tensor's dtype, shape, place in the segment, and the
checksums of its pieces), the errors a reader or publisher raises, and the layout of a segment. Needs only torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 64  # every tensor's bytes start at a multiple of this in a segment


class WeightVersionError(LookupError):
    """The requested policy version does not exist (never published, or already deleted)."""


class SharedMemoryError(OSError):
    """A version could not be written to shared memory (too little room, a failed write); nothing of it is left."""


class WeightChecksumError(RuntimeError):
    """Bytes read for a policy version differ from what was published: the version must not be served."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksums: tuple[int, ...]  # a hash (Manifest.checksum) of each _CHUNK-byte piece of its bytes, from publish


@dataclass(frozen=True)
class Manifest:
    version: int
    host: str
    segment: str | None  # shared-memory file name, when the bytes went through shm
    in_torchstore: bool
    entries: dict[str, TensorEntry]
    checksum: str  # the hash of TensorEntry.checksums: "xxh3_64" or "crc32"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @property
    def segment_size(self) -> int:
        """Bytes of tensors in its segment, alignment included (the `size` `layout` returned)."""
        return max((e.offset + e.nbytes for e in self.entries.values()), default=0)


def layout(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[dict[str, TensorEntry], int]:
    """Each tensor's place in a segment (64-byte aligned, in `dtype` or its own), and the segment's size. The
    entries' checksums are empty until the tensors are published (`checksums`)."""
    entries, offset = {}, 0
    for name, tensor in state_dict.items():
        tensor_dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * tensor_dtype.itemsize  # a DTensor's numel and shape are the full tensor's
        entries[name] = TensorEntry(str(tensor_dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes, ())
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, offset


def check_compatible(manifest: Manifest, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Refuse weights whose names or shapes differ from the receiver's, listing the first mismatches."""
    problems = []
    for name in sorted(set(specs) - set(manifest.entries))[:5]:
        problems.append(f"missing {name}")
    for name in sorted(set(manifest.entries) - set(specs))[:5]:
        problems.append(f"unexpected {name}")
    for name in sorted(set(specs) & set(manifest.entries)):
        if tuple(specs[name][0]) != tuple(manifest.entries[name].shape):
            problems.append(f"{name}: shape {list(manifest.entries[name].shape)} vs expected {list(specs[name][0])}")
        if len(problems) >= 10:
            break
    if problems:
        raise ValueError(f"policy version {manifest.version} does not match the model: " + "; ".join(problems))
