"""Checksums of a version's bytes, and the chunked, threaded byte work that takes and checks them.

A hash of each _CHUNK-byte piece of a tensor's bytes, computed once when it is published and checked by every reader
right after it reads that piece, on the same thread: a reader never returns bytes that differ from what was
published, and a mismatch names the tensor and the version. xxh3-64 where the `xxhash` package is installed, crc32
from the standard library elsewhere; the manifest names the one used. Both release the GIL, so pieces spread over
threads (`run_pieces`). A sum of an int64 view is as fast as xxh3 but misses bytes moved within a piece.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

try:
    import xxhash
except ImportError:  # a dependency of forge (pyproject.toml), but a reader may run elsewhere: crc32 then
    xxhash = None

from forge.weights.manifest import Manifest, WeightChecksumError

_CHUNK = 32 << 20  # bytes per checksum, and per task of the reading threads: they share big tensors evenly
_HASH_STEP = 256 << 10  # bytes a reader reads, then hashes while they are in its core's cache (2 MB of L2 here)
_THREADED_BYTES = 64 << 20  # below this one thread is faster than handing chunks to a pool
_IO_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"  # what this process publishes with

def checksums(tensor: torch.Tensor, algorithm: str) -> tuple[int, ...]:
    """The hash of each _CHUNK-byte piece of a contiguous CPU tensor's bytes (the pieces readers read)."""
    digest, pieces = hash_function(algorithm), _chunks(_bytes_of(tensor))
    sums = [0] * len(pieces)

    def checksum(index: int, view: memoryview) -> None:
        sums[index] = digest(view)

    _run_io(checksum, list(enumerate(pieces)), tensor.numel() * tensor.element_size())
    return tuple(sums)


def piece_ends(manifest: Manifest) -> list[int]:
    """Where each piece a reader reads and hashes on its own ends in the segment's tensor bytes, in order, and the
    segment's end: what a writer that fills the segment in order (a stream, forge/weights/relay.py) marks ready, so
    that every reader waits for no byte it does not need."""
    ends = [entry.offset + min(start + _CHUNK, entry.nbytes)
            for entry in sorted(manifest.entries.values(), key=lambda entry: entry.offset)
            for start in range(0, entry.nbytes, _CHUNK)]
    return ends + [manifest.segment_size] if not ends or ends[-1] < manifest.segment_size else ends


def hash_function(algorithm: str) -> Callable[[memoryview], int]:
    if algorithm == "crc32":
        return zlib.crc32
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise WeightChecksumError("this version's checksums are xxh3_64, which needs the xxhash package in the "
                                      "reading process: pip install xxhash (the publisher had it)")
        return xxhash.xxh3_64_intdigest
    raise ValueError(f"checksum={algorithm!r}: must be 'xxh3_64' or 'crc32'")


class _Hasher:
    """hash_function(algorithm) over bytes given in steps (the same value as over all of them at once)."""

    def __init__(self, algorithm: str) -> None:
        self._digest = hash_function(algorithm)  # also refuses an unknown algorithm, or xxh3_64 without xxhash
        self._state = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: memoryview) -> None:
        if self._state is not None:
            self._state.update(data)
        else:
            self._crc = self._digest(data, self._crc)

    def digest(self) -> int:
        return self._state.intdigest() if self._state is not None else self._crc


def verify(name: str, tensor: torch.Tensor, manifest: Manifest) -> None:
    """Raise WeightChecksumError unless `tensor`'s bytes are the ones published as `name` in the version."""
    found = checksums(tensor.detach().cpu().contiguous(), manifest.checksum)
    published = manifest.entries[name].checksums
    published += (None,) * (len(found) - len(published))
    _raise_on_mismatch(manifest, [(name, i, got, want) for i, (got, want) in enumerate(zip(found, published))
                                  if got != want])


def _mismatches(found: dict[tuple[str, int], int], published: dict[str, tuple[int, ...]]
                ) -> list[tuple[str, int, int, int | None]]:
    """(name, piece, found, published or None) of every piece whose hash differs from, or is missing in, `published`."""
    return [(name, index, got, sums[index] if index < len(sums) else None)
            for (name, index), got in found.items() for sums in [published[name]]
            if index >= len(sums) or got != sums[index]]


def _raise_on_mismatch(manifest: Manifest, mismatches: list[tuple[str, int, int, int | None]]) -> None:
    """WeightChecksumError for the first of `mismatches` (name, piece, found, published) of the bytes stored."""
    if not mismatches:
        return
    names = sorted({name for name, *_ in mismatches})
    name, index, found, published = min(mismatches, key=lambda m: m[:2])
    entry = manifest.entries[name]
    start, nbytes, algorithm = index * _CHUNK, entry.nbytes, manifest.checksum
    expected = "no checksum was published" if published is None else f"published {algorithm} {published:#x}"
    raise WeightChecksumError(
        f"policy version {manifest.version}: tensor {name!r} does not match the checksum taken when it was "
        f"published (bytes {start}..{min(start + _CHUNK, nbytes)} of {nbytes}: {algorithm} {found:#x}, {expected}); "
        f"corrupted tensors: {names}. The version is not served.")


# --- chunked, threaded byte work -----------------------------------------------------------------------------
def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[i : i + _CHUNK] for i in range(0, len(view), _CHUNK)]


def _run_io(work: Callable[[object, memoryview], None], pieces: list[tuple[object, memoryview]], nbytes: int,
            threads: int | None = None) -> None:
    """`work(key, view)` for every piece; on up to `threads` (default _IO_THREADS) threads when there is enough to
    share (preadv and the hashes release the GIL, and one core cannot saturate memory bandwidth on its own)."""
    threads = min(_IO_THREADS if threads is None else threads, len(pieces))
    if threads <= 1 or nbytes < _THREADED_BYTES:
        for key, view in pieces:
            work(key, view)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="weight-io") as pool:
        for done in [pool.submit(work, key, view) for key, view in pieces]:
            done.result()
