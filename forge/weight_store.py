"""Versioned policy weights: published by trainers, fetched by generators, from any actor in any process.

    store = WeightStore()
    await store.publish(hf_state_dict, version=3, dtype=torch.bfloat16)   # trainer: every rank, if sharded
    v = await store.latest_version()                  # generator: is there something newer?
    weights = await store.fetch(v)                    # {hf_name: tensor}; or fetch(v, into=existing)
    await store.delete(1)

Keys and metadata live in torchstore (its controller is reachable from every process of the job). Publishing
streams: one tensor at a time is cast to the readers' dtype (on its own rank, before any copy), gathered to rank
0 alone, and written, so the publisher never holds more than one extra tensor. The tensor bytes take one of two
paths:
- "shm" (one host): the publisher writes every tensor once into one shared-memory segment in /dev/shm, after
  checking that /dev/shm has room for all of it; a version whose write fails leaves nothing behind.
  Readers on the host read it straight into their own tensors (preadv); no per-tensor RPC at all. Large
  state dicts are read in 32 MB chunks on up to 8 threads (1 GB: 0.27 s on one thread, 0.15 s on two). The
  file of a deleted version is kept as a spare and rewritten by the next publish: fresh shared-memory
  pages cost more to fault in than the copy itself.
- "torchstore" (across hosts): one torchstore key per tensor (`put` / `get`), which uses RDMA where Monarch
  has it.
With transport="auto" a version goes through shared memory, and readers on another host fall back to
torchstore when the publisher also put it there (`cross_host=True`).

Segments are named `forge-<job>-<namespace>-v<version>` where <job> is the controller's pid
(FORGE_JOB_ID): `delete` removes one, `remove_job_segments` (run at shutdown, and for dead jobs at
start-up) removes whatever a crash left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

import torch.distributed as dist

from forge import compat
from forge.distributed import gather_to_rank0, group_rank, group_size

ts = compat.import_torchstore()

SHM_DIR = Path(os.environ.get("FORGE_SHM_DIR", "/dev/shm"))
_ALIGN = 64
Transport = Literal["auto", "shm", "torchstore"]


class WeightVersionError(LookupError):
    """The requested policy version does not exist (never published, or already deleted)."""


class SharedMemoryError(OSError):
    """A version could not be written to shared memory (too little room, a failed write); nothing of it is left."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    version: int
    host: str
    segment: str | None  # shared-memory file name, when the bytes went through shm
    in_torchstore: bool
    entries: dict[str, TensorEntry]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def job_id() -> str:
    """Identifies this job's segments; set by the provisioner for every process it spawns."""
    return os.environ.setdefault("FORGE_JOB_ID", str(os.getpid()))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still write into the shared-memory folder."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


class WeightStore:
    def __init__(self, namespace: str = "policy", *, transport: Transport = "auto", cross_host: bool = False) -> None:
        if transport not in ("auto", "shm", "torchstore"):
            raise ValueError(f"transport={transport!r}: must be one of 'auto', 'shm', 'torchstore'")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace):
            raise ValueError(f"namespace={namespace!r}: use letters, digits, '_', '.', '-'")
        self.namespace = namespace
        self.transport = transport
        self.cross_host = cross_host
        self.host = socket.gethostname()

    # --- keys ---------------------------------------------------------------------------------------
    def _manifest_key(self, version: int) -> str:
        return f"{self.namespace}/manifest/{version}"

    def _tensors_key(self, version: int) -> str:
        return f"{self.namespace}/tensors/{version}"

    def _latest_key(self) -> str:
        return f"{self.namespace}/latest"

    def segment_name(self, version: int) -> str:
        return f"forge-{job_id()}-{self.namespace}-v{version}"

    def _spare_path(self) -> Path:
        return SHM_DIR / f"forge-{job_id()}-{self.namespace}-spare"

    # --- publishing ---------------------------------------------------------------------------------
    async def publish(self, state_dict: dict[str, torch.Tensor], version: int, *, dtype: torch.dtype | None = None,
                      group: dist.ProcessGroup | None = None) -> Manifest | None:
        """Make `state_dict` (HF names) available as `version`, every tensor cast to `dtype` when given.

        With torch.distributed initialized this is a collective over `group` (default: all ranks), each rank
        passing its shards (DTensors): every tensor is gathered to rank 0 alone, one at a time, and streamed
        into the store there. Readers see the version only once all of it is in place. Returns the manifest on
        rank 0, None on the others. Raises SharedMemoryError when /dev/shm has too little room (on every rank,
        before anything is written) or a write fails (the partial segment is removed)."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}: must be an int >= 0")
        is_writer = group_rank(group) == 0
        use_shm = self.transport in ("auto", "shm")
        use_ts = self.transport == "torchstore" or (self.transport == "auto" and self.cross_host)
        entries, size = _layout(state_dict, dtype)
        segment = await asyncio.to_thread(self._open_segment, version, size, group) if use_shm else None
        put_keys = []
        try:
            for name, tensor in state_dict.items():
                full = await asyncio.to_thread(_gather_and_write, tensor, dtype, group, segment, entries[name].offset)
                if full is not None and use_ts:
                    put_keys.append(f"{self._tensors_key(version)}/{name}")
                    await ts.put(put_keys[-1], full)
            if segment is not None:
                await asyncio.to_thread(segment.commit)
        except BaseException:
            if segment is not None:
                segment.abort()
            for key in put_keys:
                await ts.delete(key)
            raise
        if not is_writer:
            return None
        manifest = Manifest(version, self.host, None if segment is None else segment.path.name, use_ts, entries)
        await ts.put(self._manifest_key(version), manifest)
        # `latest` only moves forward, and only after the bytes are in place.
        latest = await self.latest_version()
        if latest is None or version > latest:
            await ts.put(self._latest_key(), version)
        return manifest

    def _open_segment(self, version: int, size: int, group: dist.ProcessGroup | None) -> _SegmentWriter | None:
        """Rank 0's segment for `version` (None on the other ranks), once /dev/shm has room for it. A refusal
        reaches every rank of `group`, so none starts gathering tensors that nobody will write."""
        refusal, segment = None, None
        if group_rank(group) == 0:
            spare = self._spare_path()
            reusable = spare.stat().st_blocks * 512 if spare.exists() else 0  # the spare is rewritten in place
            needed, free = _HEADER + size, shm_free_bytes()
            if needed > free + reusable:
                refusal = (f"publishing policy version {version} needs {needed} bytes in {SHM_DIR}, but {free} are "
                           f"free ({reusable} more reusable from a deleted version); nothing was written. Free "
                           "shared memory, keep fewer versions, or publish in a smaller dtype")
            else:
                try:
                    segment = _SegmentWriter(SHM_DIR / self.segment_name(version), size, version,
                                             spare if spare.exists() else None)
                except OSError as e:
                    refusal = f"publishing policy version {version}: cannot create its segment in {SHM_DIR} ({e})"
        if group_size(group) > 1:
            message = [refusal]
            dist.broadcast_object_list(message, group_src=0, group=group)
            refusal = message[0]
        if refusal is not None:
            raise SharedMemoryError(refusal)
        return segment

    # --- reading ------------------------------------------------------------------------------------
    async def latest_version(self) -> int | None:
        """The newest published version, or None before the first publish."""
        if not await ts.exists(self._latest_key()):
            return None
        return await ts.get(self._latest_key())

    async def versions(self) -> list[int]:
        prefix = f"{self.namespace}/manifest/"
        return sorted(int(k[len(prefix) :]) for k in await _keys_with_prefix(prefix) if k[len(prefix) :].isdigit())

    async def manifest(self, version: int) -> Manifest:
        key = self._manifest_key(version)
        if not await ts.exists(key):
            raise WeightVersionError(
                f"policy version {version} is not in the weight store ({self.namespace!r}); "
                f"available versions: {await self.versions()}"
            )
        return await ts.get(key)

    async def fetch(self, version: int, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Version `version` as {name: tensor}: copied into `into`'s tensors when given (names and shapes must
        match), else fresh tensors."""
        manifest = await self.manifest(version)
        if into is not None:
            check_compatible(manifest, {n: (tuple(t.shape), t.dtype) for n, t in into.items()})
        if manifest.segment is not None and manifest.host == self.host:
            try:
                return await asyncio.to_thread(_read_segment, SHM_DIR / manifest.segment, manifest, into)
            except FileNotFoundError:
                raise WeightVersionError(
                    f"policy version {version} was deleted while being fetched; available versions: {await self.versions()}"
                ) from None
        if manifest.in_torchstore:
            key = self._tensors_key(version)
            return {name: await ts.get(f"{key}/{name}", inplace_tensor=None if into is None else into[name])
                    for name in manifest.entries}
        raise WeightVersionError(
            f"policy version {version} was published to shared memory on host {manifest.host!r} only; this process "
            f"is on {self.host!r}. Publish with WeightStore(cross_host=True) (or transport='torchstore') for multi-host jobs."
        )

    # --- deleting -----------------------------------------------------------------------------------
    async def delete(self, version: int) -> None:
        manifest = await self.manifest(version)
        await ts.delete(self._manifest_key(version))
        if manifest.segment is not None and manifest.host == self.host:
            segment = SHM_DIR / manifest.segment
            if self._spare_path().exists():
                segment.unlink(missing_ok=True)
            else:  # kept (under another name) for the next publish to write into
                with contextlib.suppress(FileNotFoundError):
                    os.replace(segment, self._spare_path())
        if manifest.in_torchstore:
            for key in await _keys_with_prefix(self._tensors_key(version) + "/"):
                await ts.delete(key)

    async def delete_older_than(self, version: int) -> list[int]:
        """Delete every version below `version` (what no generator or trainer can still need)."""
        old = [v for v in await self.versions() if v < version]
        for v in old:
            await self.delete(v)
        return old


async def _keys_with_prefix(prefix: str) -> list[str]:
    return await compat.keys_with_prefix(ts, prefix)


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


_HEADER = 64  # the segment starts with its version (int64), written last and checked by readers


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


_CHUNK = 32 << 20  # bytes per preadv call: big tensors are split so reading threads share the work evenly
_THREADED_BYTES = 64 << 20  # below this one thread is faster than handing chunks to a pool
_IO_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))


def _chunks(view: memoryview, offset: int) -> list[tuple[memoryview, int]]:
    return [(view[i : i + _CHUNK], offset + i) for i in range(0, len(view), _CHUNK)]


def _run_io(io: Callable[[memoryview, int], None], chunks: list[tuple[memoryview, int]]) -> None:
    """`io(view, file_offset)` for every chunk; on several threads when there is enough to share (preadv
    releases the GIL, and one core cannot saturate memory bandwidth on its own)."""
    threads = min(_IO_THREADS, len(chunks))
    if threads <= 1 or sum(len(view) for view, _ in chunks) < _THREADED_BYTES:
        for view, offset in chunks:
            io(view, offset)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="weight-io") as pool:
        for done in [pool.submit(io, view, offset) for view, offset in chunks]:
            done.result()


def _layout(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[dict[str, TensorEntry], int]:
    """Each tensor's place in a segment (64-byte aligned, in `dtype` or its own), and the segment's size."""
    entries, offset = {}, 0
    for name, tensor in state_dict.items():
        tensor_dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * tensor_dtype.itemsize  # a DTensor's numel and shape are the full tensor's
        entries[name] = TensorEntry(_dtype_name(tensor_dtype), tuple(tensor.shape), offset, nbytes)
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, offset


def _gather_and_write(tensor: torch.Tensor, dtype: torch.dtype | None, group: dist.ProcessGroup | None,
                      segment: _SegmentWriter | None, offset: int) -> torch.Tensor | None:
    """One tensor cast on its own rank (shards before they travel), gathered to rank 0 and written there;
    returns the full CPU tensor on rank 0, None on the others."""
    full = gather_to_rank0(tensor.detach().to(dtype or tensor.dtype), group)
    if full is None:
        return None
    full = full.cpu().contiguous()
    if segment is not None:
        segment.write(full, offset)
    return full


class _SegmentWriter:
    """A version's segment, written tensor by tensor into `<name>.tmp` with pwrite and renamed to its real name
    once complete, so readers never see a half-written one. A failed write removes the file at once (and
    later writes are skipped, so the other ranks' gathers still complete); `commit` then raises its error.

    Reusing a deleted version's file (`spare`) skips the page faults and zeroing of fresh shared memory, the
    slow part of writing a new file. One thread writes: writes to one tmpfs file serialize on its inode lock.
    """

    def __init__(self, path: Path, size: int, version: int, spare: Path | None) -> None:
        self.path, self.tmp, self.version = path, path.with_name(path.name + ".tmp"), version
        self.error: OSError | None = None
        if spare is not None:
            with contextlib.suppress(FileNotFoundError):
                os.replace(spare, self.tmp)
        self.fd: int | None = os.open(self.tmp, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.pwrite(self.fd, struct.pack("<q", -1), 0)  # a reader still on the reused file fails its version check
            os.ftruncate(self.fd, _HEADER + max(size, 1))
        except BaseException:
            self.abort()
            raise

    def write(self, tensor: torch.Tensor, offset: int) -> None:
        if self.fd is None:
            return
        data, done = _bytes_of(tensor), 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], _HEADER + offset + done)
        except OSError as e:  # ENOSPC: /dev/shm filled up after the check
            self.error = e
            self.abort()

    def commit(self) -> None:
        if self.error is not None:
            raise SharedMemoryError(
                f"publishing policy version {self.version}: writing {self.tmp} failed ({self.error}); "
                "the partial segment was removed and nothing was published") from self.error
        os.pwrite(self.fd, struct.pack("<q", self.version), 0)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.tmp.unlink(missing_ok=True)


def _read_segment(path: Path, manifest: Manifest, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """preadv straight into the destination tensors (fresh ones, or `into`'s when they are plain CPU tensors)."""
    fd = os.open(path, os.O_RDONLY)

    def read(view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise WeightVersionError(f"policy version {manifest.version}: segment {path.name} is truncated")
            done += got

    try:
        _check_header(fd, manifest.version)
        out, staged = {}, {}
        for name, entry in manifest.entries.items():
            dtype = getattr(torch, entry.dtype)
            target = into[name] if into is not None else torch.empty(entry.shape, dtype=dtype)
            direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype
            out[name] = target
            staged[name] = target if direct else torch.empty(entry.shape, dtype=dtype)
        _run_io(read, [chunk for name, buffer in staged.items()
                       for chunk in _chunks(_bytes_of(buffer), _HEADER + manifest.entries[name].offset)])
        with torch.no_grad():
            for name, buffer in staged.items():
                if buffer is not out[name]:
                    out[name].copy_(buffer)
        _check_header(fd, manifest.version)  # the file was not recycled while we read it
    finally:
        os.close(fd)
    return out


def _check_header(fd: int, version: int) -> None:
    (found,) = struct.unpack("<q", os.pread(fd, 8, 0))
    if found != version:
        raise WeightVersionError(f"policy version {version} was deleted while being fetched")


def job_segments_bytes(job: str | None = None) -> int:
    """Bytes of shared memory held by `job`'s segments (default: this job)."""
    return sum(path.stat().st_size for path in SHM_DIR.glob(f"forge-{job or job_id()}-*") if path.exists())


def remove_job_segments(job: str | None = None) -> list[Path]:
    """Unlink every shared-memory segment of `job` (default: this job). Run at shutdown."""
    job = job or job_id()
    removed = []
    for path in SHM_DIR.glob(f"forge-{job}-*"):
        path.unlink(missing_ok=True)
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
