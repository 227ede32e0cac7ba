"""A policy version's bytes in one shared-memory file on a host: the writer (a publisher, or a relay's copy), the
readers (every generator on the host), the mappings, and the clean-up of a job's segments. Needs only torch and the
standard library: no Monarch, no torchstore (forge/weights/store.py adds the keys and manifests on top).

A segment is a 64-byte header and every tensor's bytes, 64-byte aligned, at the offsets `layout` gives. The
header holds three int64s: the version once complete (written last; -1 while being written, -2 once abandoned),
how many tensor bytes from the start are in place ("ready": each piece counts once written and checksummed, and
never before its hash is taken), and the version being written. The writer copies the tensors into `<name>.tmp`,
through a mapping of the file that it keeps for the next version written into the same file (a deleted version's,
reused), and renames it when complete. Its buffer can be pinned for a device's DMA (`SegmentWriter.host_buffer`,
forge/weights/publisher.py). Readers preadv straight into their tensors, in pieces spread over threads; or take
views of a private mapping of the segment (`map_segment`, no copy), which lease the file while they live: a leased
file is deleted, never rewritten as the spare. A reader may start while the segment is still being written (a
version streamed to another host, forge/weights/relay.py; read on one thread then): each piece is read once "ready"
covers it, and the version is returned only once its segment is complete and every piece matches the publisher's
checksum (forge/weights/checksums.py), so no caller ever gets half a version.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import numpy
import torch

from forge.job import job_id, register_cleanup
from forge.weights import checksums as _sums
from forge.weights.checksums import (_bytes_of, _chunks, _Hasher, _mismatches, _raise_on_mismatch, _run_io,
                                     hash_function)
from forge.weights.manifest import (ALIGN, Manifest, SharedMemoryError, TensorEntry, WeightChecksumError,
                                    WeightVersionError)

SHM_DIR = Path(os.environ.get("FORGE_SHM_DIR", "/dev/shm"))
HEADER = 64  # the segment starts with its state (see the module's docstring)
_COMMITTED, _READY, _WRITING = 0, 8, 16  # header offsets: version once complete, ready bytes, version being written
WRITING, ABANDONED = -1, -2  # the header's "complete" field until the segment is complete, or after a failed write
RETIRED = -3  # the header's "version being written" once the file is a deleted version's, kept as the spare
ARRIVAL_STALL_S = 60.0  # a reader of a segment still being written gives up when no byte arrived for this long

def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still write into the shared-memory folder."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def _read_and_hash(fd: int, view: memoryview, offset: int, algorithm: str) -> int | None:
    """preadv `view` from `fd` at `offset` in _sums._HASH_STEP steps, hashing each step right after it is read (while it is
    still in this core's cache: 1 GB read and hashed took ~0.29 core-s so, ~0.33 hashing each 32 MB piece after
    reading it whole); the hash of all of it, the same as hash_function(algorithm)(view). None: the file ended
    before `view` was full."""
    hasher, done = _Hasher(algorithm), 0
    while done < len(view):
        step = view[done : done + _sums._HASH_STEP]
        got = os.preadv(fd, [step], offset + done)
        if got == 0:
            return None
        hasher.update(step[:got])
        done += got
    return hasher.digest()


def create_segment(path: Path, size: int, version: int, spare: Path | None) -> SegmentWriter:
    """A writer for `version`'s segment at `path`, once the shared-memory folder has room for `size` bytes of
    tensors (a `spare` file, a deleted version's, is rewritten in place and counts as room)."""
    _drop_unlinked_mappings()  # the memory of a file deleted since the last publish is free for the check below
    reusable = spare.stat().st_blocks * 512 if spare is not None and spare.exists() else 0
    needed, free = HEADER + size, shm_free_bytes()
    if needed > free + reusable:
        raise SharedMemoryError(
            f"publishing policy version {version} needs {needed} bytes in {SHM_DIR}, but {free} are free ({reusable} "
            "more reusable from a deleted version); nothing was written. Deleted versions whose weights a generator "
            "still holds count as used until it lets go of them. Free shared memory, keep fewer versions, or "
            "publish in a smaller dtype")
    try:
        return SegmentWriter(path, size, version, spare if spare is not None and spare.exists() else None)
    except OSError as e:
        raise SharedMemoryError(f"publishing policy version {version}: cannot create its segment in {SHM_DIR} ({e})") from e


class SegmentWriter:
    """A version's segment, written piece by piece into `<name>.tmp` and renamed to its real name once complete.
    After each piece its "ready" count moves forward, so another process can stream or read what is in place
    while the rest is being written (never past it). A failed write marks the segment abandoned and removes the
    file at once (and later writes are skipped, so the other ranks' gathers still complete); `commit` then raises
    its error.

    Reusing a deleted version's file (`spare`) skips allocating and zeroing fresh shared memory, the slow part of
    writing a new file; and the file's pages are all in place, so the bytes are copied in through a mapping of it
    (`_Mapping`: kept by this process for the next version it writes into the same file), where no copy can meet a
    missing page (which on a full /dev/shm is SIGBUS, not an error). A new file, or one that grew, is written with
    pwrite (a full /dev/shm: ENOSPC); mapping it first would zero every page before the copy (fallocate leaves
    them unwritten: 1 GB took 0.56 s so, pwrite 0.27 s).
    """

    def __init__(self, path: Path, size: int, version: int, spare: Path | None) -> None:
        self.path, self.tmp, self.version, self.size = path, path.with_name(path.name + ".tmp"), version, size
        self.error: OSError | None = None
        self.ready = 0  # tensor bytes from the start in place (the header's copy)
        self._mappable = False  # whether the file has all its pages: copied in through a mapping then
        self._target: memoryview | None = None  # the file's bytes, mapped on the first copy
        self._mapping_lock = threading.Lock()
        self._ready_lock = threading.Lock()
        self._written: dict[int, int] = {}  # pieces in place past `ready`: start -> end
        if spare is not None:
            with contextlib.suppress(FileNotFoundError):
                os.replace(spare, self.tmp)
        self.fd: int | None = os.open(self.tmp, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            # In this order, one field per pwrite: a process that sees this version in _WRITING sees ready=0 (a
            # reader still on the reused file fails its version check).
            os.pwrite(self.fd, struct.pack("<q", WRITING), _COMMITTED)
            os.pwrite(self.fd, struct.pack("<q", 0), _READY)
            os.pwrite(self.fd, struct.pack("<q", version), _WRITING)
            os.ftruncate(self.fd, self._length)
            self._mappable = os.fstat(self.fd).st_blocks * 512 >= self._length  # tmpfs counts the pages it holds
        except BaseException:
            self.abort()
            raise

    @property
    def _length(self) -> int:
        return HEADER + max(self.size, 1)

    def write(self, tensor: torch.Tensor, offset: int) -> None:
        """Copy a contiguous CPU tensor's bytes in at `offset` (from `layout`), then mark them ready once everything
        before them is in place (`ready` never covers a gap)."""
        data = _bytes_of(tensor)
        self._copy(data, offset)
        self.piece_written(offset, offset + len(data))

    def piece_written(self, start: int, end: int) -> None:
        """Tensor bytes start..end are in place and hashed (pieces may complete in any order, on any thread): `ready`
        moves over every piece that now follows it without a gap (up to a tensor's alignment padding)."""
        with self._ready_lock:
            self._written[start] = max(end, self._written.get(start, end))
            ready = self.ready
            while True:
                reachable = [at for at in self._written if at <= -(-ready // ALIGN) * ALIGN]
                if not reachable:
                    break
                for at in reachable:
                    ready = max(ready, self._written.pop(at))
            if ready > self.ready and self.fd is not None:
                self.mark_ready(ready)

    def write_checksummed(self, tensor: torch.Tensor, offset: int, algorithm: str) -> tuple[int, ...]:
        """`write_piece` of each _CHUNK piece in order, on this thread; returns the pieces' checksums."""
        nbytes = tensor.numel() * tensor.element_size()
        return tuple(self.write_piece(tensor, offset, start, min(start + _sums._CHUNK, nbytes), algorithm)
                     for start in range(0, nbytes, _sums._CHUNK))

    def write_piece(self, tensor: torch.Tensor, offset: int, start: int, end: int, algorithm: str, *,
                    device_copy: bool | None = None) -> int:
        """Bytes start..end of contiguous `tensor` (stored at tensor offset `offset`) copied in and hashed, then marked
        written; returns their hash. Safe from several threads at once, on disjoint pieces: the copies (numpy's, or
        torch's copy_ from a device) and the hashes release the GIL. A CPU tensor is hashed _HASH_STEP bytes at a time
        right before those bytes are copied (while they are in this core's cache: read from memory once); a tensor
        on a device (`device_copy`, default: whether it is on one) is copied straight into the segment (its own DMA
        target where the mapping is pinned, `pin_for_device`), then the segment's bytes are hashed. No byte is
        marked ready before its hash is taken."""
        hasher = _Hasher(algorithm)
        if device_copy is None:
            device_copy = tensor.device.type != "cpu"
        if not device_copy:
            data = _bytes_of(tensor)[start:end]
            for at in range(0, len(data), _sums._HASH_STEP):
                step = data[at : at + _sums._HASH_STEP]
                hasher.update(step)
                self._copy(step, offset + start + at)
        else:
            stored = self._stored_view(offset + start, end - start)
            if stored is None:  # no mapping (a fresh file): through host memory, then as a CPU tensor
                staged = tensor.detach().reshape(-1).view(torch.uint8)[start:end].cpu()
                return self.write_piece(staged, offset + start, 0, end - start, algorithm, device_copy=False)
            stored.copy_(tensor.detach().reshape(-1).view(torch.uint8)[start:end], non_blocking=True)
            if tensor.device.type == "cuda":
                torch.cuda.current_stream(tensor.device).synchronize()
            data = self._mapped()[HEADER + offset + start : HEADER + offset + end]
            for at in range(0, len(data), _sums._HASH_STEP):
                hasher.update(data[at : at + _sums._HASH_STEP])
        digest = hasher.digest()
        self.piece_written(offset + start, offset + end)
        return digest

    def _stored_view(self, offset: int, nbytes: int) -> torch.Tensor | None:
        """The segment's bytes at tensor offset `offset` as a uint8 tensor (a copy_ target), where it is mapped."""
        target = self._mapped() if self._mappable else None
        if target is None:
            return None
        return torch.frombuffer(target, dtype=torch.uint8, count=nbytes, offset=HEADER + offset)

    def pin_for_device(self) -> bool:
        """Register the segment's mapping with CUDA (cudaHostRegister), so that a device's copy lands in it by DMA
        with no staging buffer; kept with the mapping for the versions written into the file later. False where
        there is no CUDA or no mapping (a fresh file: written through host memory then)."""
        if not torch.cuda.is_available():
            return False
        target = self._mapped() if self._mappable else None
        if target is None:
            return False
        mapping = _mapping_of(self.fd, self._length)
        return mapping.pin()

    def _copy(self, data: memoryview, offset: int) -> None:
        """Copy `data` in at tensor offset `offset`, through the mapping where the file has all its pages (numpy's
        copy, which releases the GIL), else with pwrite. The next mark's pwrite orders the copied bytes before it."""
        target = self._mapped() if self._mappable else None
        if target is None:
            self._pwrite(data, offset)
            return
        into = numpy.frombuffer(target, dtype=numpy.uint8, count=len(data), offset=HEADER + offset)
        into[:] = numpy.frombuffer(data, dtype=numpy.uint8)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        """pwrite all of `data` at tensor offset `offset`; a failure marks the segment abandoned (see `write`)."""
        if self.fd is None:
            return
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], HEADER + offset + done)
        except OSError as e:  # ENOSPC: /dev/shm filled up after the check
            self.error = e
            self.abort()

    def _mapped(self) -> memoryview | None:
        """The file's bytes in this process's mapping of it; None where it cannot be mapped (pwrite then) or once
        abandoned. Several threads may copy."""
        if self._target is None and self.fd is not None and self._mappable:
            with self._mapping_lock:
                if self._target is None and self.fd is not None and self._mappable:
                    try:
                        self._target = _mapping_of(self.fd, self._length).view
                    except OSError:  # ENOMEM (too many mappings): the pwrite works as well, more slowly
                        self._mappable = False
        return self._target

    def mark_ready(self, nbytes: int) -> None:
        """The first `nbytes` tensor bytes are in place (and hashed): readers and streams may take them."""
        fd = self.fd
        if fd is None:  # abandoned meanwhile (another piece's write failed)
            return
        os.pwrite(fd, struct.pack("<q", nbytes), _READY)
        self.ready = nbytes

    def commit(self) -> None:
        if self.error is not None:
            raise SharedMemoryError(
                f"publishing policy version {self.version}: writing {self.tmp} failed ({self.error}); "
                "the partial segment was removed and nothing was published") from self.error
        os.pwrite(self.fd, struct.pack("<q", self.size), _READY)
        os.pwrite(self.fd, struct.pack("<q", self.version), _COMMITTED)
        os.close(self.fd)
        self.fd, self._target = None, None  # the mapping stays, for the next version written into this file
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):  # whoever streams or reads it stops at once
                os.pwrite(self.fd, struct.pack("<q", ABANDONED), _COMMITTED)
            os.close(self.fd)
            self.fd = None
        self._target = None
        unlink_segment(self.tmp)


class _Mapping:
    """A writable shared mapping of a segment file, all its pages mapped at once (MAP_POPULATE), kept by the process
    that wrote a version into the file for the next version it writes into the same file (a deleted version's, reused
    as the spare): writing through a kept mapping is faster than pwrite, and mapping the file again would rebuild
    its page tables each version."""

    def __init__(self, fd: int, length: int) -> None:
        self.map = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.view = memoryview(self.map)
        self.fd = os.dup(fd)  # which file it maps, and whether that file is still linked
        self.pinned = False  # registered with CUDA (`pin`)

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA's DMA (once); False when CUDA refuses."""
        if not self.pinned:
            address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(address, len(self.map), 0)) == 0
            self._address = address
        return self.pinned

    def close(self) -> None:
        """Forget the file: its memory goes back once no writer copies through it (when the last reference goes)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self.pinned = False
        os.close(self.fd)


_MAPPINGS: dict[tuple[int, int], _Mapping] = {}  # this process's, by the file's (device, inode): renames keep them
_MAPPINGS_LOCK = threading.Lock()


def _mapping_of(fd: int, length: int) -> _Mapping:
    """This process's mapping of the first `length` bytes of the file open as `fd`: kept from a version written into
    the file before, or new."""
    stat = os.fstat(fd)
    key = (stat.st_dev, stat.st_ino)
    with _MAPPINGS_LOCK:
        mapping = _MAPPINGS.get(key)
        if mapping is not None and len(mapping.map) != length:
            _MAPPINGS.pop(key).close()
            mapping = None
        if mapping is None:
            mapping = _MAPPINGS[key] = _Mapping(fd, length)
        return mapping


def _drop_unlinked_mappings() -> None:
    """Forget the mappings of files that were deleted (by any process): a mapping would hold their memory."""
    with _MAPPINGS_LOCK:
        for key, mapping in list(_MAPPINGS.items()):
            if os.fstat(mapping.fd).st_nlink == 0:
                _MAPPINGS.pop(key).close()


def unlink_segment(path: Path) -> None:
    """Delete a segment's file; its memory is free once this returns (this process's mapping of it goes too; another
    publisher process's goes on its next publish)."""
    path.unlink(missing_ok=True)
    _drop_unlinked_mappings()


def retire_segment(path: Path, spare: Path) -> None:
    """A deleted version's segment becomes the `spare` the next publish writes into (no fresh shared memory to
    allocate and zero), or is deleted when a spare is already kept (one spare per store, never more) or while a
    reader's tensors are views of it (`map_segment`'s lease: such a file is never rewritten; its memory goes back
    once the last of them is dropped)."""
    if spare.exists():
        unlink_segment(path)
        return
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            unlink_segment(path)
            return
        # No longer a version: a reader that takes its lease after this one is released refuses the file, and one
        # still reading it (a stream, an arriving read) stops at once rather than waiting for a writer.
        os.pwrite(fd, struct.pack("<q", RETIRED), _WRITING)
        os.pwrite(fd, struct.pack("<q", WRITING), _COMMITTED)
        os.replace(path, spare)
    finally:
        os.close(fd)


# --- reading -----------------------------------------------------------------------------------------------
def read_segment(path: Path, manifest: Manifest, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The version's tensors read from its complete segment at `path` straight into fresh tensors, or `into`'s
    (names and shapes must match; plain CPU tensors of the published dtype are read into directly, others through
    a staging tensor), every piece checked against its published checksum. Raises WeightVersionError when the
    segment was deleted or recycled meanwhile, WeightChecksumError naming every tensor whose bytes differ (`into`'s
    tensors then hold what was read: not weights to serve)."""
    return SegmentRead(path, manifest, into, arriving=False).verified(manifest)


def map_segment(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The version's tensors as views of one private mapping of its complete segment at `path`: no copy (the pages
    are the ones the publisher wrote, shared by every reader on the host; a write to a tensor lands in a private
    copy of its page, never in the file), every piece hashed in place and checked against its published checksum.
    While any of the tensors lives, the mapping holds a shared lock on the file (its lease): `retire_segment` never
    rewrites a leased file, it deletes it, and the file's memory stays in /dev/shm until the last view goes.
    WeightVersionError when the segment was deleted or is being reused, WeightChecksumError naming every tensor
    whose bytes differ."""
    version = manifest.version
    fd = open_segment_file(path, version, arriving=False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # retire_segment holds it for the moment it takes to make it the spare
            raise WeightVersionError(f"policy version {version} was deleted while being fetched ({path.name})") from None
        writing, complete, _ = segment_state(fd)  # after the lock: a file retired before it says so
        length = HEADER + max(manifest.segment_size, 1)
        if (writing, complete) != (version, version) or os.fstat(fd).st_size < length:
            raise WeightVersionError(f"policy version {version} was deleted while being fetched ({path.name})")
        # The mapping keeps its own descriptor of the file, and with it the lease, for as long as a tensor uses it.
        # Not MAP_POPULATE: on a writable private mapping it copies every page up front; faulted in by the hash
        # below, the pages stay the file's (no copy).
        segment = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        _check_in_place(segment, manifest)
    except BaseException:
        segment.close()  # the lease goes now, not with the exception's traceback
        raise
    tensors = {}
    for name, entry in manifest.entries.items():
        dtype = getattr(torch, entry.dtype)
        if entry.nbytes == 0:
            tensors[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(segment, dtype=torch.uint8, count=entry.nbytes, offset=HEADER + entry.offset)
        tensors[name] = raw.view(dtype).view(entry.shape)
    return tensors


def _check_in_place(segment: mmap.mmap, manifest: Manifest) -> None:
    """Hash every piece of the mapped segment's tensors and compare with the published checksums: WeightChecksumError
    naming every tensor whose bytes differ. Holds no view of the mapping once it returns or raises."""
    digest, found = hash_function(manifest.checksum), {}

    def check(piece: tuple[str, int], data: memoryview) -> None:
        found[piece] = digest(data)

    with memoryview(segment) as view:
        pieces = [((name, i), piece) for name, entry in manifest.entries.items()
                  for i, piece in enumerate(_chunks(view[HEADER + entry.offset : HEADER + entry.offset + entry.nbytes]))]
        try:
            _run_io(check, pieces, manifest.nbytes)
        finally:
            for _, piece in pieces:
                piece.release()
    _raise_on_mismatch(manifest, _mismatches(found, {n: e.checksums for n, e in manifest.entries.items()}))


class SegmentRead:
    """Reads a version's segment piece by piece into tensors, hashing each piece on its reading thread right after
    reading it. With `arriving`, the segment may still be being written (its `<name>.tmp`): each piece is read once
    the writer marked it ready, and the read returns once the segment is complete. Its hashes are compared with the
    publisher's by `verified`, which alone hands out the tensors. WeightVersionError when the writer abandoned the
    segment, the file was recycled or deleted, or (arriving) no byte arrived for ARRIVAL_STALL_S."""

    def __init__(self, path: Path, manifest: Manifest, into: dict[str, torch.Tensor] | None, *, arriving: bool) -> None:
        self.manifest, self.into = manifest, into
        self.found: dict[tuple[str, int], int] = {}
        fd = open_segment_file(path, manifest.version, arriving)
        try:
            progress = SegmentProgress(fd, manifest.version, path.name, ARRIVAL_STALL_S if arriving else None)
            self.out, self.staged = {}, {}
            for name, entry in manifest.entries.items():
                dtype = getattr(torch, entry.dtype)
                target = into.get(name) if into is not None else None
                if target is None:
                    target = torch.empty(entry.shape, dtype=dtype)
                direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype
                self.out[name] = target
                self.staged[name] = target if direct else torch.empty(entry.shape, dtype=dtype)
            hash_function(manifest.checksum)  # an unknown algorithm fails here, before any read

            def read(piece: tuple[str, int, TensorEntry], view: memoryview) -> None:
                name, index, entry = piece
                offset = entry.offset + index * _sums._CHUNK
                progress.wait_until_ready(offset + len(view))
                found = _read_and_hash(fd, view, HEADER + offset, manifest.checksum)
                if found is None:
                    raise WeightVersionError(f"policy version {manifest.version}: segment {path.name} is truncated")
                self.found[name, index] = found

            pieces = [((name, i, manifest.entries[name]), view) for name, buffer in self.staged.items()
                      for i, view in enumerate(_chunks(_bytes_of(buffer)))]
            # A segment still arriving comes no faster than the link: one thread per reader keeps up with it, and
            # more would only take cores from the stream.
            _run_io(read, pieces, manifest.nbytes, threads=1 if arriving else _sums._IO_THREADS)
            progress.wait_until_complete()  # and the file was not recycled while we read it
        finally:
            os.close(fd)

    def verified(self, published: Manifest) -> dict[str, torch.Tensor]:
        """The tensors read, once every piece matched `published`'s checksums (the publisher's manifest of the
        same version and layout); WeightChecksumError naming every tensor whose bytes differ, else."""
        for name, entry in self.manifest.entries.items():
            other = published.entries.get(name)
            if other is None or (other.offset, other.nbytes, other.dtype) != (entry.offset, entry.nbytes, entry.dtype):
                raise WeightVersionError(f"policy version {published.version}: tensor {name!r} was published at "
                                         "another place or size than the segment that was read holds it")
        mismatches = _mismatches(self.found, {n: e.checksums for n, e in published.entries.items()})
        _raise_on_mismatch(published, mismatches)
        with torch.no_grad():
            for name, buffer in self.staged.items():
                if buffer is not self.out[name]:
                    self.out[name].copy_(buffer)
        return self.out


def open_segment_file(path: Path, version: int, arriving: bool) -> int:
    """A read-only descriptor of the segment at `path`, or (arriving) of the `<name>.tmp` it is still written as."""
    candidates = [path, path.with_name(path.name + ".tmp"), path] if arriving else [path]  # renamed in between
    for candidate in candidates:
        with contextlib.suppress(FileNotFoundError):
            return os.open(candidate, os.O_RDONLY)
    raise WeightVersionError(f"policy version {version} was deleted while being fetched (no {path.name} in {SHM_DIR})")


def segment_state(fd: int) -> tuple[int, int, int]:
    """(version being written, complete version or WRITING/ABANDONED, ready bytes) of the segment open as `fd`.
    Two reads, the version being written first: the writer sets it after resetting the others, so what follows
    belongs to it (or to a later reuse of the file, which changes it again)."""
    (writing,) = struct.unpack("<q", os.pread(fd, 8, _WRITING))
    complete, ready = struct.unpack("<qq", os.pread(fd, 16, _COMMITTED))
    return writing, complete, ready


class SegmentProgress:
    """How much of `version` the segment open as `fd` holds, shared by a read's threads (or a stream to another
    host, forge/weights/relay.py); waits for more."""

    def __init__(self, fd: int, version: int, name: str, stall_s: float | None) -> None:
        self.fd, self.version, self.name, self.stall_s = fd, version, name, stall_s
        self.ready, self.complete, self.changed = 0, False, time.monotonic()
        self.lock = threading.Lock()
        self._poll()

    def _poll(self) -> None:
        writing, complete, ready = segment_state(self.fd)
        if complete == self.version and writing == self.version:
            self.complete = True
            return
        if self.complete or self.stall_s is None or writing != self.version or complete != WRITING or ready < self.ready:
            what = "abandoned by its writer" if writing == self.version and complete == ABANDONED else "deleted"
            raise WeightVersionError(f"policy version {self.version} was {what} while being fetched ({self.name})")
        if ready > self.ready:
            self.ready, self.changed = ready, time.monotonic()
        elif time.monotonic() - self.changed > self.stall_s:
            raise WeightVersionError(f"policy version {self.version}: no byte of it arrived in {self.name} for "
                                     f"{self.stall_s:.0f} s (its writer stopped)")

    def _wait(self, done: Callable[[], bool]) -> None:
        pause = 0.0002
        while True:
            with self.lock:
                if done():
                    return
                self._poll()
                if done():
                    return
            time.sleep(pause)
            pause = min(2 * pause, 0.004)

    def wait_until_ready(self, end: int) -> None:
        self._wait(lambda: self.complete or self.ready >= end)

    def wait_until_complete(self) -> None:
        with self.lock:
            if self.complete:
                self._poll()  # once more: still this version's complete file after every read
        self._wait(lambda: self.complete)


# --- a job's segments --------------------------------------------------------------------------------------
def job_segments_bytes(job: str | None = None) -> int:
    """Bytes of shared memory held by `job`'s segments (default: this job)."""
    return sum(path.stat().st_size for path in SHM_DIR.glob(f"forge-{job or job_id()}-*") if path.exists())


def remove_job_segments(job: str | None = None) -> list[Path]:
    """Unlink every shared-memory segment of `job` (default: this job). Run at shutdown."""
    job = job or job_id()
    removed = []
    for path in SHM_DIR.glob(f"forge-{job}-*"):
        unlink_segment(path)
        removed.append(path)
    return removed


def remove_dead_jobs_segments() -> list[Path]:
    """Segments left by jobs whose controller process is gone (a crash, a SIGKILL)."""
    import psutil

    removed = []
    for path in SHM_DIR.glob("forge-*-*"):
        match = re.match(r"forge-(\d+)-", path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# The runtime removes this job's segments when the job ends, and dead jobs' when a controller starts (forge/job.py).
register_cleanup("shared-memory segments", remove_job_segments, remove_dead_jobs_segments)
