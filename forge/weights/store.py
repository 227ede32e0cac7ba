"""Versioned policy weights: published by trainers, fetched by generators, from any actor in any process.

    store = WeightStore()
    await store.publish(hf_state_dict, version=3, dtype=torch.bfloat16)   # trainer: every rank, if sharded
    v = await store.latest_version()                  # generator: is there something newer?
    weights = await store.fetch(v)                    # {hf_name: tensor}, views of shared memory; or into=existing
    await store.delete(1)

Keys and metadata live in torchstore (its controller is reachable from every process of the job). Publishing
streams: one tensor at a time is cast to the readers' dtype (on its own rank, before any copy), gathered to rank
0 alone, and its pieces written and hashed on a pool of threads (forge/weights/publisher.py) while the next one is
gathered, so the publisher holds a bounded number of extra pieces. The tensor bytes take one of two
paths:
- "shm" (one host; forge/weights/segment.py, which needs no Monarch): the publisher writes every tensor once into
  one shared-memory segment in /dev/shm, after checking that /dev/shm has room for all of it; a version whose
  write fails leaves nothing behind. A reader on the host that passes its own tensors (`fetch(v, into=...)`)
  reads the version straight into them (preadv); one that does not (the Generator) gets views of the segment,
  hashed in place and never copied (segment.map_segment): one copy of the weights per host, however many
  readers. No per-tensor RPC at all. The file of a deleted version is kept as a spare and rewritten by the next
  publish (fresh shared-memory pages cost more to fault in than the copy itself), unless a reader still holds
  views of it (its lease): then it is deleted, and its memory goes back when the last view does.
- "torchstore" (across hosts): one torchstore key per tensor (`put` / `get`), which uses RDMA where Monarch
  has it.
With transport="auto" a version goes through shared memory, and readers on another host fall back to
torchstore when the publisher also put it there (`cross_host=True`).

Several hosts (FORGE_MULTI_HOST=1, set by the provisioner in every process of a multi-host job): the publisher
writes its own host's segment (and, where torchstore has RDMA, puts the version into torchstore once); one relay per
host (forge/weights/relay.py) copies it into its host's /dev/shm -- streamed from the publisher host's segment over
TCP, or from torchstore with RDMA -- and advertises it under that host's keys.
Without RDMA the stages overlap: the publisher announces the version (`incoming`, its layout without checksums)
before writing it; the relays start streaming its pieces as they are written, announce their host's copy, and that
host's readers read each piece as it lands. A reader returns the version only once all of it arrived and every
piece matched the checksums in the publisher's final manifest (segment.SegmentRead): never half a version.
Readers learn of a version through one path, `latest_version` / `wait_for_version`: their host's newest version,
complete or arriving, never one whose bytes cannot yet be read on their host. They read it from their host's shared
memory, and record how many versions their host's complete copy is behind the newest published one (metric
`weights/host_versions_behind`).

Every tensor's checksums (a hash per 32 MB, forge/weights/checksums.py) are taken once at publish and kept in the manifest; `fetch` checks
what it read against them on either path and raises WeightChecksumError, naming the tensor and the version,
instead of returning weights that differ from what was published.

Each version records `weights/published_bytes`.

Segments are named `forge-<job>-<namespace>-v<version>` where <job> is the controller's pid
(FORGE_JOB_ID): `delete` removes one, `remove_job_segments` (registered with the runtime's clean-up,
forge/job.py: run when the job ends, and for dead jobs when a controller starts) removes whatever a crash left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import socket
import time
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from forge import compat
from forge.distributed import group_rank, group_size
from forge.job import MULTI_HOST_VARIABLE, job_id
from forge.metrics import record_metric
from forge.weights import checksums as _sums
from forge.weights.checksums import verify
from forge.weights.manifest import (  # noqa: F401 (the errors and Manifest are re-exported)
    Manifest,
    SharedMemoryError,
    TensorEntry,
    WeightChecksumError,
    WeightVersionError,
    check_compatible,
    layout,
)
from forge.weights.publisher import PieceWriter, gathered
from forge.weights.segment import (  # noqa: F401 (SHM_DIR and the job_* helpers are re-exported)
    SHM_DIR,
    SegmentRead,
    SegmentWriter,
    create_segment,
    job_segments_bytes,
    map_segment,
    read_segment,
    remove_dead_jobs_segments,
    remove_job_segments,
    retire_segment,
)

ts = compat.import_torchstore()

Transport = Literal["auto", "shm", "torchstore"]
RELAY_VARIABLE = MULTI_HOST_VARIABLE  # "1" in every process of a multi-host job (the runtime sets it)
RELAY_NAMESPACES_KEY = "forge-weight-relay/namespaces"  # the namespaces published in this job, for the relays


# A host's relay copies each version once for all its readers; a big model's copy takes a while on a slow link.
RELAY_WAIT_S = 300.0
# How long a reader waits for a version that is neither published nor being published before it is an error (a
# reader may ask for a version just before its publish is announced).
UNPUBLISHED_WAIT_S = 1.0


def torchstore_has_rdma() -> bool:
    """Whether torchstore moves tensors by RDMA here (then the relays pull versions from torchstore)."""
    from torchstore.transport.buffers import rdma_available

    return rdma_available()


def relayed() -> bool:
    """Whether this process is part of a multi-host job, whose hosts each have a weight relay."""
    return os.environ.get(RELAY_VARIABLE) == "1"


class WeightStore:
    def __init__(self, namespace: str = "policy", *, transport: Transport = "auto", cross_host: bool = False) -> None:
        if transport not in ("auto", "shm", "torchstore"):
            raise ValueError(f"transport={transport!r}: must be one of 'auto', 'shm', 'torchstore'")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace):
            raise ValueError(f"namespace={namespace!r}: use letters, digits, '_', '.', '-'")
        self.namespace = namespace
        self.transport = transport
        self.relayed = relayed()
        self.cross_host = cross_host or self.relayed  # the relays copy versions from torchstore
        self.host = socket.gethostname()
        self._registered = False

    # --- keys ---------------------------------------------------------------------------------------
    def _manifest_key(self, version: int) -> str:
        return f"{self.namespace}/manifest/{version}"

    def tensors_key(self, version: int) -> str:
        return f"{self.namespace}/tensors/{version}"

    def _latest_key(self) -> str:
        return f"{self.namespace}/latest"

    def host_latest_key(self, host: str) -> str:
        """The newest version in `host`'s shared memory (relayed jobs)."""
        return f"{self.namespace}/hosts/{host}/latest"

    def host_manifest_key(self, host: str, version: int) -> str:
        """The manifest of `version`'s copy in `host`'s shared memory (written by that host's relay)."""
        return f"{self.namespace}/hosts/{host}/manifest/{version}"

    def _incoming_key(self) -> str:
        return f"{self.namespace}/incoming"

    def host_incoming_key(self, host: str) -> str:
        """The layout of the version `host`'s relay is streaming into its shared memory (readers may start)."""
        return f"{self.namespace}/hosts/{host}/incoming"

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
        # Across hosts without RDMA, torchstore moves bytes in actor messages, far below a link's rate: the relays
        # stream the publisher's segment instead, and torchstore carries only keys and manifests.
        use_ts = self.transport == "torchstore" or (self.transport == "auto" and self.cross_host
                                                    and (not self.relayed or torchstore_has_rdma()))
        entries, size = layout(state_dict, dtype)
        algorithm = _sums.CHECKSUM
        segment = await asyncio.to_thread(self._open_segment, version, size, group) if use_shm else None
        put_keys, announced = [], None
        if segment is not None and self.relayed and not use_ts:
            # The relays stream its pieces as they are written (no checksums yet: those come with the manifest).
            incoming = Manifest(version, self.host, segment.path.name, False, entries, algorithm)
            announced = asyncio.ensure_future(ts.put(self._incoming_key(), incoming))
        # Rank 0 writes and hashes each tensor's pieces on a pool of threads while the next tensor is gathered.
        pieces = PieceWriter(segment, algorithm) if is_writer else None
        try:
            for name, tensor in state_dict.items():
                payload = await asyncio.to_thread(_gather_and_store, name, tensor, dtype, group, entries[name].offset,
                                                  pieces, use_ts)
                if payload is None:
                    continue
                if use_ts:
                    put_keys.append(f"{self.tensors_key(version)}/{name}")
                    await ts.put(put_keys[-1], payload)
            if pieces is not None:
                sums = await asyncio.to_thread(pieces.finish)
                entries = {name: dataclasses.replace(entry, checksums=sums[name]) for name, entry in entries.items()}
            if announced is not None:
                await announced
            if segment is not None:
                await asyncio.to_thread(segment.commit)
        except BaseException:
            if pieces is not None:
                await asyncio.to_thread(pieces.abort)  # no piece is written once the segment is abandoned
            if segment is not None:
                segment.abort()  # marks it abandoned: a relay streaming it stops, and its host's readers with it
            if announced is not None:
                with contextlib.suppress(Exception):
                    await announced
                    await ts.delete(self._incoming_key())
            for key in put_keys:
                await ts.delete(key)
            raise
        if not is_writer:
            return None
        manifest = Manifest(version, self.host, None if segment is None else segment.path.name, use_ts, entries,
                            algorithm)
        record_metric("weights/published_bytes", manifest.nbytes, "sum")
        await ts.put(self._manifest_key(version), manifest)
        # `latest` only moves forward, and only after the bytes are in place.
        latest = await self.published_version()
        if latest is None or version > latest:
            await ts.put(self._latest_key(), version)
            if self.relayed:  # this host's readers have it in shared memory already
                await ts.put(self.host_latest_key(self.host), version)
        if self.relayed:
            await self._register_namespace()
        return manifest

    async def _register_namespace(self) -> None:
        """Tell the relays to follow this namespace (checked on every publish: a lost concurrent update heals)."""
        if self._registered:
            return
        names = await get_if_exists(RELAY_NAMESPACES_KEY) or []
        if self.namespace not in names:
            await ts.put(RELAY_NAMESPACES_KEY, [*names, self.namespace])
        else:
            self._registered = True

    def _open_segment(self, version: int, size: int, group: dist.ProcessGroup | None) -> SegmentWriter | None:
        """Rank 0's segment for `version` (None on the other ranks), once /dev/shm has room for it. A refusal
        reaches every rank of `group`, so none starts gathering tensors that nobody will write."""
        refusal, segment = None, None
        if group_rank(group) == 0:
            try:
                segment = create_segment(SHM_DIR / self.segment_name(version), size, version, self._spare_path())
            except SharedMemoryError as e:
                refusal = str(e)
        if group_size(group) > 1:
            message = [refusal]
            dist.broadcast_object_list(message, group_src=0, group=group)
            refusal = message[0]
        if refusal is not None:
            raise SharedMemoryError(refusal)
        return segment

    # --- reading ------------------------------------------------------------------------------------
    async def published_version(self) -> int | None:
        """The newest published version, or None before the first publish."""
        return await get_if_exists(self._latest_key())

    async def latest_version(self) -> int | None:
        """The newest version this process can read: the newest published one; in a relayed job, the newest in
        this host's shared memory or arriving there (its relay is streaming it: `fetch` reads it as it lands and
        returns it once complete and verified); None before the host has one. How far this host's newest complete
        copy is behind the newest published version is recorded (a host whose relay falls behind serves what it
        has, never silently)."""
        published = await self.published_version()
        if not self.relayed:
            return published
        on_host = await get_if_exists(self.host_latest_key(self.host))
        if published is not None:
            record_metric("weights/host_versions_behind", published - (-1 if on_host is None else on_host), "max")
        arriving = await self._arriving_on_host()
        return max((v for v in (on_host, arriving and arriving.version) if v is not None), default=None)

    async def incoming(self) -> Manifest | None:
        """The layout of the newest version the publisher started writing and the relays may stream (None before
        the first, or after its publish failed)."""
        return await get_if_exists(self._incoming_key())

    async def _arriving_on_host(self) -> Manifest | None:
        return await get_if_exists(self.host_incoming_key(self.host))

    async def versions(self) -> list[int]:
        prefix = f"{self.namespace}/manifest/"
        return sorted(int(k[len(prefix) :]) for k in await _keys_with_prefix(prefix) if k[len(prefix) :].isdigit())

    async def manifest(self, version: int) -> Manifest:
        manifest = await get_if_exists(self._manifest_key(version))
        if manifest is None:
            raise WeightVersionError(
                f"policy version {version} is not in the weight store ({self.namespace!r}); "
                f"available versions: {await self.versions()}"
            )
        return manifest

    async def fetch(self, version: int, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Version `version` as {name: tensor}: copied into `into`'s tensors when given (names and shapes must
        match); else views of its segment where this host holds it whole (`map_segment`), fresh tensors otherwise
        (torchstore, a version still arriving). Every tensor is checked against the checksums taken when it was
        published: WeightChecksumError (naming the tensor and the version) rather than weights that differ from them."""
        manifest, arriving = await self._locate(version)
        if into is not None:
            check_compatible(manifest, {n: (tuple(t.shape), t.dtype) for n, t in into.items()})
        return (await self._read_stored(manifest, arriving, into))[1]

    async def _locate(self, version: int) -> tuple[Manifest, bool]:
        """`version`'s manifest where this process reads it, and whether it is still arriving on this host."""
        if self.relayed:
            return await self._relayed_manifest(version)
        return await self.manifest(version), False

    async def _read_stored(self, manifest: Manifest, arriving: bool,
                           into: dict[str, torch.Tensor] | None) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The version's tensors (into `into`'s where it has them), each checked against the publisher's checksums;
        and the publisher's manifest."""
        version = manifest.version
        if arriving:  # read as its host's relay streams it in; checked against the publisher's final checksums
            read = await asyncio.to_thread(SegmentRead, SHM_DIR / manifest.segment, manifest, into, arriving=True)
            # The relay completes its copy only once the publisher's final manifest is in torchstore: no wait here.
            published = await self._published_manifest(version, wait_s=0.0)
            return published, await asyncio.to_thread(read.verified, published)
        if manifest.segment is not None and manifest.host == self.host:
            # A caller with no tensors of its own gets views of the segment (its lease keeps the file from being
            # rewritten).
            try:
                if into is None:
                    return manifest, await asyncio.to_thread(map_segment, SHM_DIR / manifest.segment, manifest)
                return manifest, await asyncio.to_thread(read_segment, SHM_DIR / manifest.segment, manifest, into)
            except FileNotFoundError:
                raise WeightVersionError(
                    f"policy version {version} was deleted while being fetched; available versions: {await self.versions()}"
                ) from None
        if manifest.in_torchstore:
            if self.relayed:  # a version this host's relay has not copied: each reader crosses the link
                record_metric("weights/fetches_past_relay", 1, "sum")
            key = self.tensors_key(version)
            fetched = {}
            for name, entry in manifest.entries.items():
                target = into.get(name) if into is not None else None
                fetched[name] = await ts.get(f"{key}/{name}", inplace_tensor=target)
                verify(name, fetched[name].to(getattr(torch, entry.dtype)), manifest)
            return manifest, fetched
        raise WeightVersionError(
            f"policy version {version} was published to shared memory on host {manifest.host!r} only; this process "
            f"is on {self.host!r}. Publish with WeightStore(cross_host=True) (or transport='torchstore') for multi-host jobs."
        )

    async def _relayed_manifest(self, version: int) -> tuple[Manifest, bool]:
        """Where this process reads `version` in a relayed job, and whether it is still arriving, looked up once (no
        waiting: `latest_version` names only versions readable here, `wait_for_version` waits for one): this host's
        relayed copy (it stays readable until the relay replaces it, even once the trainer deleted the version); the
        copy this host's relay is streaming in; the publisher's own segment when it is on this host.
        WeightVersionError else, naming where the version is."""
        copy = await get_if_exists(self.host_manifest_key(self.host, version))
        if copy is not None:
            return copy, False
        arriving = await self._arriving_on_host()
        if arriving is not None and arriving.version == version:
            return arriving, True
        published = await self.manifest(version)  # the usual error for a version not published, naming what is
        if published.host == self.host and published.segment is not None:
            return published, False
        raise WeightVersionError(f"policy version {version} is not readable on host {self.host!r} yet: its weight "
                                 f"relay has not started copying it (wait_for_version waits for it)")

    async def wait_for_version(self, at_least: int, timeout_s: float = RELAY_WAIT_S, poll_s: float = 0.05) -> int:
        """The newest version readable on this host (`latest_version`), once it is `at_least`: the one path by which
        a reader learns of a version, never before its bytes can be read on its host (in a relayed job, once this
        host's relay holds it or is streaming it in). WeightVersionError when no version `at_least` was published
        nor is being published after UNPUBLISHED_WAIT_S (a reader may ask as its publish starts), or after
        `timeout_s` when none reached this host."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            latest = await self.latest_version()
            if latest is not None and latest >= at_least:
                return latest
            published = await self.published_version() if self.relayed else latest
            if (published is None or published < at_least) and time.monotonic() - started >= UNPUBLISHED_WAIT_S:
                incoming = await self.incoming()
                if incoming is None or incoming.version < at_least:  # nor being published: nothing will come
                    raise WeightVersionError(
                        f"a reader needs policy version >= {at_least}, but "
                        f"{'no version is published' if published is None else f'the newest published is {published}'}")
            if time.monotonic() >= deadline:
                raise WeightVersionError(f"policy version {at_least} has not reached host {self.host!r}: its weight "
                                         f"relay did not copy it within {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    async def _published_manifest(self, version: int, wait_s: float = 10.0) -> Manifest:
        """`version`'s manifest with the publisher's checksums: the publisher's (in place before any relay finishes
        a copy), or, once the trainer deleted it, this host's copy's (its relay puts it right after the copy)."""
        deadline = time.monotonic() + wait_s
        while True:
            for key in (self._manifest_key(version), self.host_manifest_key(self.host, version)):
                manifest = await get_if_exists(key)
                if manifest is not None:
                    return manifest
            if time.monotonic() > deadline:
                raise WeightVersionError(f"policy version {version} was deleted before its checksums could be read")
            await asyncio.sleep(0.01)

    # --- deleting -----------------------------------------------------------------------------------
    async def delete(self, version: int) -> None:
        manifest = await self.manifest(version)
        await ts.delete(self._manifest_key(version))
        if manifest.segment is not None and manifest.host == self.host:
            retire_segment(SHM_DIR / manifest.segment, self._spare_path())
        if manifest.in_torchstore:
            for key in await _keys_with_prefix(self.tensors_key(version) + "/"):
                await ts.delete(key)

    async def delete_older_than(self, version: int) -> list[int]:
        """Delete every version below `version` (what no generator or trainer can still need)."""
        versions = await self.versions()
        old = [v for v in versions if v < version]
        for v in old:
            await self.delete(v)
        return old


async def _keys_with_prefix(prefix: str) -> list[str]:
    return await compat.keys_with_prefix(ts, prefix)


async def get_if_exists(key: str):
    """The value at `key`, or None when there is none: one call to torchstore (its `get` raises KeyError for a
    missing key), not two (exists, then get). Readers and relays poll these keys, and each call costs CPU in the
    caller, torchstore's controller and its storage volume."""
    try:
        return await ts.get(key)
    except KeyError:
        return None


def _gather_and_store(name: str, tensor: torch.Tensor, dtype: torch.dtype | None, group: dist.ProcessGroup | None,
                      offset: int, pieces: PieceWriter | None, on_host: bool) -> torch.Tensor | None:
    """One tensor cast, gathered to rank 0 and queued there for `pieces` (written at `offset` of the segment and
    hashed; the checksums come with `PieceWriter.finish`). Returns the gathered tensor (copied into host memory where
    `on_host`: it goes to torchstore); None on the other ranks."""
    full = gathered(tensor, dtype, group)
    if full is None:
        return None
    if on_host:
        full = full.cpu().contiguous()
    pieces.add(name, full, offset)
    return full
