"""One weight relay per host of a multi-host job: each policy version crosses the link to a host once, not
once per generator on it.

The trainer publishes a version once (forge/weights/store.py: its own host's shared memory; torchstore too where
torchstore has RDMA). The relay on every other host notices the new version and copies it into its host's /dev/shm
(forge/weights/segment.py): with RDMA, its tensors from torchstore; without, the publisher host's whole segment, streamed
by that host's relay (`SegmentServer`: one TCP connection, the kernel's sendfile; torchstore moves bytes in actor
messages at ~0.05-0.2 GB/s on CPU, a TCP stream at the link's speed). Then it advertises that copy under its host's
keys; that host's generators read it there like on the trainer's host, checking every tensor's checksum.

A relay learns of a new version from the other hosts' SegmentServers: each follows its host's shared-memory folder
(inotify) and tells every other relay when a segment of the job starts, completes or goes there (`watch`), so an
idle relay costs no CPU; it also polls torchstore every second for what no event announces (the namespaces, a
version published without a segment on its host, a lost event). Events rather than fast polling keep an idle
job's relays off the cores (docs/benchmarks.md has the figures).

The stream is pipelined: the publisher announces a version before writing it (`WeightStore.incoming`), the relay
starts at once and the server sends each piece as soon as the publisher marked it ready (written and checksummed);
the relay moves it from the socket into its host's new segment (splice: one copy, by the kernel), marks each piece
the readers read ready as it lands and announces the copy (`host_incoming_key`), so the host's readers read and hash
each piece as it lands. The relay completes its copy
only once the publisher's segment is complete and its final manifest (the checksums) is in torchstore; readers
compare against those before returning the version.

Every connection to a SegmentServer starts with the job's handshake (forge/job_auth.py: a challenge and an HMAC under
the job's secret, both ways; the secret made by the controller, in the environment of the job's processes only). A
client without the secret gets the challenge and the end of the connection, never a byte of a segment or an event;
one that says nothing is dropped after job_auth.HANDSHAKE_TIMEOUT_S (each connection has its own thread, so it
holds up no other). The server listens on its host's
configured address only (forge.hosts.agent.host_address), never on every interface. The bytes cross the network in
the clear: the trust boundary is the job's private network (docs/several_hosts.md, "Sockets and trust").

Versions only move forward: a relay that falls behind skips to the newest published version (counted in
`relay/versions_skipped`), and until it has copied one its host's readers keep the version they have
(`weights/host_versions_behind`, recorded by every reader). The relay deletes its host's copies of versions the
trainer deleted, keeping its newest. A watchdog process (`_WATCHDOG`) removes the job's segments on this host
once the relay process is gone, also when it was SIGKILLed (its host's allocator kills it when the controller
dies): a killed process cannot clean up after itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import ipaddress
import logging
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Iterator

from forge import compat
from forge import job_auth
from forge.endpoints import EndpointActor
from monarch.actor import endpoint  # noqa: E402 (after forge.compat)
from forge.hosts.agent import host_address
from forge.job_auth import JobAuthenticationError, job_secret
from forge.metrics import record_metric
from forge.job import job_id
from forge.weights.checksums import piece_ends
from forge.weights.manifest import Manifest, SharedMemoryError, WeightVersionError
from forge.weights.segment import (
    ARRIVAL_STALL_S,
    HEADER,
    SHM_DIR,
    SegmentProgress,
    SegmentWriter,
    create_segment,
    open_segment_file,
    retire_segment,
)
from forge.weights.store import RELAY_NAMESPACES_KEY, WeightStore, get_if_exists

logger = logging.getLogger(__name__)

ts = compat.import_torchstore()

_CONCURRENT_GETS = 4  # tensors in flight from torchstore at once: overlaps the link with the shm writes
SERVERS_KEY = "forge-weight-relay/servers"  # {host: that host's SegmentServer address}
# Thorough polls (everything, also what no event announces) are _THOROUGH_EVERY * poll_s apart: each torchstore call
# costs ~4 ms of CPU across the processes it involves here, and an idle 2-host job whose relays polled every 50 ms
# took ~0.34 of a core.
_THOROUGH_EVERY = 20
# After a `started` event: how long to poll for the publisher's announcement in torchstore (put right after it created
# the segment; a version published without one, through torchstore, completes with a `changed` event), and how often
# at first (doubling up to poll_s).
_ANNOUNCEMENT_WAIT_S = 1.0
_ANNOUNCEMENT_POLL_S = 0.005
_PIPE_BYTES = 1 << 20  # the receiver's pipe (the most an unprivileged process may ask for): bytes per splice
_HELLO = b"forge segment server/1\n"  # then the handshake's challenge (forge.job_auth)


def connect(address: tuple[str, int], secret: bytes, timeout: float | None) -> socket.socket:
    """A connection to the SegmentServer at `address`, past the handshake; `timeout` applies from then on."""
    return job_auth.connect(address, secret, _HELLO, timeout)


class SegmentServer:
    """Serves this host's segments of this job to other hosts' relays: a request is a segment's name and a newline;
    the answer is its size (int64; -1: no such segment), its tensor bytes in order, each sent (by the kernel,
    sendfile) as soon as its writer marked it ready, and last its header once the segment is complete. A segment
    abandoned, recycled or stalled for ARRIVAL_STALL_S ends the connection early: the receiver then fails.

    The request `watch` instead keeps the connection and sends a line `<kind> <namespace> <version>` whenever a
    segment of this job appears, completes or goes on this host (inotify on its shared-memory folder): `started`
    when a writer created it (the publisher announces its layout in torchstore right after), `changed` else.
    Segments this process writes itself (`own`: its relay's copies) are left out. Other hosts' relays wait on these
    lines instead of polling torchstore; a lost line costs only latency (they still poll, rarely)."""

    def __init__(self, address: str, secret: bytes) -> None:
        if ipaddress.ip_address(address).is_unspecified:
            raise ValueError(f"SegmentServer address {address!r}: listen on this host's own address, not on every "
                             "interface")
        self._secret = secret
        self._names = re.compile(rf"forge-{re.escape(job_id())}-[A-Za-z0-9_.-]+-v([0-9]+)")
        self._segments = re.compile(rf"forge-{re.escape(job_id())}-([A-Za-z0-9_.-]+)-v([0-9]+)(\.tmp)?")
        self.own: set[str] = set()  # segments this process writes (names without .tmp)
        self._refused: set[str] = set()  # addresses of clients refused (logged once each)
        self._watchers: list[socket.socket] = []
        self._watchers_lock = threading.Lock()
        self._socket = socket.create_server((address, 0))
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True, name="segment-server").start()

    def _accept(self) -> None:
        while True:
            connection, _ = self._socket.accept()
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(job_auth.HANDSHAKE_TIMEOUT_S)
            if not job_auth.client_proved(connection, self._secret, _HELLO):
                self._log_refused(connection)
                connection.close()
                return
            request = connection.makefile("rb").readline(256).decode(errors="replace").strip()
            connection.settimeout(None)  # blocking again: sendfile needs it, and a watcher waits for ever
        except OSError:  # silent past the timeout, or gone
            connection.close()
            return
        if request == "watch":
            self._add_watcher(connection)
            return
        with connection:
            self._send(connection, request)

    def _log_refused(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            peer = connection.getpeername()[0]
            if peer not in self._refused:  # once per address: a scanner must not flood the log
                self._refused.add(peer)
                logger.warning("segment server: refused %s, which does not hold this job's secret", peer)

    def _send(self, connection: socket.socket, name: str) -> None:
        with contextlib.suppress(OSError, WeightVersionError):
            match = self._names.fullmatch(name)
            try:
                if match is None:
                    raise WeightVersionError(name)
                fd = open_segment_file(SHM_DIR / name, int(match.group(1)), arriving=True)
            except WeightVersionError:
                connection.sendall(struct.pack("<q", -1))
                return
            try:
                size = os.fstat(fd).st_size
                connection.sendall(struct.pack("<q", size))
                progress, sent = SegmentProgress(fd, int(match.group(1)), name, ARRIVAL_STALL_S), 0
                while HEADER + sent < size:
                    progress.wait_until_ready(sent + 1)
                    end = size - HEADER if progress.complete else progress.ready
                    while sent < end:
                        sent += os.sendfile(connection.fileno(), fd, HEADER + sent, end - sent)
                progress.wait_until_complete()
                connection.sendall(os.pread(fd, HEADER, 0))
            finally:
                os.close(fd)

    def _add_watcher(self, connection: socket.socket) -> None:
        with self._watchers_lock:
            first = not self._watchers
            self._watchers.append(connection)
        if first:  # the folder is watched from the first watcher on, for the life of the process
            threading.Thread(target=self._watch_segments, daemon=True, name="segment-events").start()

    def _watch_segments(self) -> None:
        try:
            for name, mask in _shared_memory_events():
                match = self._segments.fullmatch(name)
                if (match is None or f"forge-{job_id()}-{match.group(1)}-v{match.group(2)}" in self.own
                        or (match.group(3) and mask & _IN_MOVED_FROM)):  # the commit's rename: told once, as moved in
                    continue
                started = match.group(3) is not None and mask & (_IN_CREATE | _IN_MOVED_TO)
                self._tell_watchers(f"{'started' if started else 'changed'} {match.group(1)} {match.group(2)}\n")
        except OSError:  # no inotify here (or its limits reached): the watchers poll instead
            logger.exception("segment server: cannot watch %s; other hosts' relays poll torchstore instead", SHM_DIR)
        with self._watchers_lock:
            for watcher in self._watchers:
                watcher.close()
            self._watchers.clear()

    def _tell_watchers(self, line: str) -> None:
        with self._watchers_lock:
            for watcher in list(self._watchers):
                try:
                    watcher.sendall(line.encode())
                except OSError:  # that relay is gone
                    watcher.close()
                    self._watchers.remove(watcher)


# inotify(7): this host's shared-memory folder's entries created, renamed in or out, or deleted.
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (of the NUL-padded name that follows)


def _shared_memory_events() -> Iterator[tuple[str, int]]:
    """(name, mask) of every entry of SHM_DIR created, deleted or renamed in or out, as it happens (forever)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
    try:
        if libc.inotify_add_watch(fd, bytes(SHM_DIR), _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {SHM_DIR}: {os.strerror(ctypes.get_errno())}")
        while True:
            data, at = os.read(fd, 1 << 16), 0
            while at < len(data):
                _, mask, _, length = _INOTIFY_EVENT.unpack_from(data, at)
                at += _INOTIFY_EVENT.size
                yield data[at : at + length].rstrip(b"\0").decode(errors="replace"), mask
                at += length
    finally:
        os.close(fd)


def receive_segment(address: tuple[str, int], manifest: Manifest, writer: SegmentWriter, secret: bytes) -> None:
    """Receive `manifest`'s segment from the SegmentServer at `address` straight into `writer`'s file, marking each
    piece this host's readers read ready as soon as it landed (they read it meanwhile). Returns once all of it is
    there and the publisher's header names the version; the caller commits. Raises (and writes nothing more) when
    the segment is gone from its host, was abandoned or recycled there, the connection broke or stalled for
    ARRIVAL_STALL_S, this host's shared memory is full (SharedMemoryError), or the server does not hold `secret`
    (JobAuthenticationError)."""
    with connect(address, secret, timeout=ARRIVAL_STALL_S) as connection:
        connection.sendall(manifest.segment.encode() + b"\n")
        (total,) = struct.unpack("<q", _receive_exactly(connection, 8))
        if total < HEADER + writer.size:
            raise WeightVersionError(f"policy version {manifest.version}: its segment {manifest.segment} is gone "
                                     f"from host {manifest.host!r}")
        done = 0
        with _Splicer(connection) as splicer:
            for end in piece_ends(manifest):
                while done < end:
                    got = splicer.receive(writer, done, end - done)
                    if got == 0:
                        raise ConnectionError(f"host {manifest.host!r} ended the stream of {manifest.segment} at "
                                              f"{done} of {writer.size} bytes (abandoned or recycled there)")
                    done += got
                writer.mark_ready(done)
        _receive_exactly(connection, total - HEADER - writer.size)  # the last tensor's alignment padding
        (complete,) = struct.unpack("<q", _receive_exactly(connection, HEADER)[:8])
        if complete != manifest.version:
            raise WeightVersionError(f"policy version {manifest.version}: its segment was recycled on host "
                                     f"{manifest.host!r} while being copied")


class _Splicer:
    """Moves a connection's bytes into a segment's file through a pipe (splice): in the kernel, through no mapping.
    Cheaper than receiving into a mapping of the segment, which costs a page fault per page and needs the file's
    blocks allocated first so that a full /dev/shm fails instead of raising SIGBUS; written through the file, a full
    /dev/shm is an error (ENOSPC)."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection, self.timeout = connection, connection.gettimeout()
        self.out, self.into = os.pipe()
        with contextlib.suppress(OSError):  # the default (64 KB) works too, with more calls
            fcntl.fcntl(self.into, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)

    def __enter__(self) -> _Splicer:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.out)
        os.close(self.into)

    def receive(self, writer: SegmentWriter, done: int, count: int) -> int:
        """At most `count` bytes from the connection into `writer`'s tensor bytes at `done`; 0 once it is closed."""
        while True:
            try:  # the connection has a timeout, so it is non-blocking: wait for bytes here
                got = os.splice(self.connection.fileno(), self.into, min(count, _PIPE_BYTES))
                break
            except BlockingIOError:
                if not select.select([self.connection], [], [], self.timeout)[0]:
                    raise TimeoutError(f"policy version {writer.version}: no byte of its stream arrived for "
                                       f"{self.timeout:.0f} s") from None
        written = 0
        try:
            while written < got:
                written += os.splice(self.out, writer.fd, got - written, offset_dst=HEADER + done + written)
        except OSError as e:  # ENOSPC: this host's /dev/shm filled up after the copy's room was checked
            raise SharedMemoryError(f"policy version {writer.version}: writing its copy {writer.tmp} failed "
                                    f"({e})") from e
        return got


def _receive_exactly(connection: socket.socket, count: int) -> bytes:
    return job_auth.receive_exactly(connection, count, "the segment server")


# Runs detached (double fork, own session, so no process-tree kill takes it along): waits for the relay process
# to be gone, then removes the job's shared-memory segments on this host.
_WATCHDOG = """
import glob, os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
pid, pattern = int(sys.argv[1]), sys.argv[2]
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.5)
for path in glob.glob(pattern):
    try:
        os.unlink(path)
    except OSError:
        pass
"""


class WeightRelay(EndpointActor):
    """Copies every namespace's new versions from torchstore into this host's shared memory."""

    def __init__(self, poll_s: float = 0.05) -> None:
        self.poll_s = poll_s
        self.host = socket.gethostname()
        self.stores: dict[str, WeightStore] = {}
        self.relayed: dict[str, int] = {}  # namespace -> newest version readable on this host
        self.copies: dict[str, dict[int, str]] = {}  # namespace -> version -> segment this relay wrote
        self.abandoned: dict[str, int] = {}  # namespace -> version whose copy failed while it was being published
        self.servers: dict[str, tuple[str, int]] = {}  # host -> its SegmentServer's address
        self.last_copy: dict = {}  # the newest copy's wall-clock times (bench/weight_sync_hosts.py prints them)
        self._task: asyncio.Task | None = None
        self._reported: set[str] = set()
        self._watching: dict[str, socket.socket | None] = {}  # host -> its server's event stream (None: connecting)
        self._news = asyncio.Event()  # set by an event from another host
        self._announced: dict[str, tuple[int, float]] = {}  # namespace -> (version started elsewhere, until when)
        self._announcement_poll_s = _ANNOUNCEMENT_POLL_S

    @endpoint
    async def setup(self) -> None:
        started = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(SHM_DIR / f"forge-{job_id()}-*")],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.wait(timeout=10)  # the first fork exits at once; the watchdog lives on, detached
        self.secret = job_secret()
        self.server = SegmentServer(host_address(), self.secret)
        self._loop = asyncio.get_running_loop()
        await self._advertise_server()
        self._task = asyncio.ensure_future(self._follow())

    @endpoint
    async def teardown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for connection in self._watching.values():
            if connection is not None:
                connection.close()

    @endpoint
    async def status(self) -> dict:
        """Where this relay runs, the newest version of each namespace readable on its host, when its newest copy
        started, was received, and was advertised (wall-clock times), and the hosts whose events it follows."""
        return {"host": self.host, "pid": os.getpid(), "relayed": dict(self.relayed), "last_copy": dict(self.last_copy),
                "watching": sorted(host for host, connection in self._watching.items() if connection is not None)}

    async def _follow(self) -> None:
        """Relay every namespace's newest version, on each event from another host (a segment started, completed
        or deleted there), and on a thorough poll every _THOROUGH_EVERY * poll_s that also reads what no event
        announces (the namespaces, versions published without a segment, the other hosts' servers). Until another
        host's events are followed, and for a moment after a `started` event whose announcement is not yet in
        torchstore, it polls every poll_s instead."""
        namespaces: list[str] = []
        thorough_at = 0.0
        while True:
            self._news.clear()  # an event from here on wakes the next wait
            thorough = time.monotonic() >= thorough_at
            if thorough:
                thorough_at = time.monotonic() + self.poll_s * _THOROUGH_EVERY
            try:
                if thorough:
                    await self._advertise_server()
                if thorough or not namespaces:
                    namespaces = await self._namespaces()
                for namespace in dict.fromkeys([*namespaces, *self._announced]):
                    await self._relay_newest(namespace, thorough)
            except Exception as error:  # counted every time, logged once per kind (a loop must not flood logs)
                record_metric("relay/failures", 1, "sum")
                kind = f"{type(error).__name__}: {str(error)[:200]}"
                if kind not in self._reported:
                    self._reported.add(kind)
                    logger.exception("weight relay on %s: a copy failed (shown once; counted in relay/failures)",
                                     self.host)
            now = time.monotonic()
            self._announced = {namespace: (version, until) for namespace, (version, until) in self._announced.items()
                               if now < until and self.relayed.get(namespace, -1) < version
                               and self.abandoned.get(namespace) != version}
            if self._announced:
                wait, self._announcement_poll_s = self._announcement_poll_s, min(2 * self._announcement_poll_s,
                                                                                 self.poll_s)
            elif not any(self._watching.values()):
                wait = self.poll_s
            else:
                wait = thorough_at - now
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), max(0.0, wait))

    async def _advertise_server(self) -> None:
        """Keep this host's SegmentServer in the job's list (one key: a concurrent update that lost it heals on the
        next thorough poll) and follow the events of every other host's."""
        servers = await get_if_exists(SERVERS_KEY) or {}
        if servers.get(self.host) != self.server.address:
            await ts.put(SERVERS_KEY, {**servers, self.host: self.server.address})
        self.servers.update(servers)
        for host, address in servers.items():
            if host != self.host and host not in self._watching:
                self._watching[host] = None
                threading.Thread(target=self._watch, args=(host, tuple(address)), daemon=True,
                                 name=f"relay-events-{host}").start()

    def _watch(self, host: str, address: tuple[str, int]) -> None:
        """Follow `host`'s SegmentServer events until its connection ends (then a thorough poll reconnects)."""
        try:
            with connect(address, self.secret, timeout=None) as connection:
                connection.sendall(b"watch\n")
                self._watching[host] = connection
                for line in connection.makefile("rb"):
                    kind, namespace, version = line.decode().split()
                    self._loop.call_soon_threadsafe(self._on_event, kind, namespace, int(version))
        except JobAuthenticationError as error:  # retried on every thorough poll: logged once
            if str(error) not in self._reported:
                self._reported.add(str(error))
                logger.error("weight relay on %s: cannot follow %s's events: %s", self.host, host, error)
        except (OSError, ValueError):
            pass
        finally:
            self._loop.call_soon_threadsafe(self._watching.pop, host, None)

    def _on_event(self, kind: str, namespace: str, version: int) -> None:
        if kind == "started":  # its announcement follows in torchstore: poll for it for a moment
            self._announced[namespace] = (version, time.monotonic() + _ANNOUNCEMENT_WAIT_S)
            self._announcement_poll_s = _ANNOUNCEMENT_POLL_S
        self._news.set()

    async def _namespaces(self) -> list[str]:
        return await get_if_exists(RELAY_NAMESPACES_KEY) or []

    async def _relay_newest(self, namespace: str, thorough: bool) -> None:
        store = self.stores.setdefault(namespace, WeightStore(namespace))
        have = self.relayed.get(namespace, -1)
        manifest = await self._newest_to_copy(store, have, thorough)
        if manifest is None:
            # A copy can finish before the trainer deletes the version it replaces: dropped on a later poll.
            if len(self.copies.get(namespace, {})) > 1:
                await self._delete_copies_the_trainer_deleted(store, keep=have)
            return
        newest = manifest.version
        if manifest.host != self.host:
            started = time.perf_counter()
            self.last_copy = {"namespace": namespace, "version": newest, "started": time.time()}
            try:
                segment, copied = await self._copy(store, manifest)
                relayed_copy = dataclasses.replace(copied, host=self.host, segment=segment)
                await ts.put(store.host_manifest_key(self.host, newest), relayed_copy)
                self.copies.setdefault(namespace, {})[newest] = segment
                record_metric("relay/bytes", copied.nbytes, "sum")
            except JobAuthenticationError:  # no copy from that host will work: counted and logged by _follow
                raise
            # Deleted, abandoned or stalled mid-copy (a receive that timed out is an OSError, not a ConnectionError):
            # take the next one.
            except (KeyError, WeightVersionError, OSError):
                record_metric("relay/abandoned_copies", 1, "sum")
                self.abandoned[namespace] = newest
                return
            await ts.put(store.host_latest_key(self.host), newest)
            self.last_copy["advertised"] = time.time()
            record_metric("relay/copy_s", time.perf_counter() - started, "mean")
        if have >= 0 and newest > have + 1:
            record_metric("relay/versions_skipped", newest - have - 1, "sum")
        self.relayed[namespace] = newest
        await self._delete_copies_the_trainer_deleted(store, keep=newest)

    async def _newest_to_copy(self, store: WeightStore, have: int, thorough: bool) -> Manifest | None:
        """The newest version past `have`: one still being published when another host's publisher streams it
        (its layout; a copy of it that failed is not retried from there), else the newest published one. While the
        newest announced version is not past `have`, the published one is read on `thorough` polls only: a version
        published without an announcement (through torchstore) is noticed on its host's `changed` event (its segment
        completed) or on the next thorough poll."""
        incoming = await store.incoming()
        if (incoming is not None and incoming.host != self.host and incoming.version > have
                and incoming.version != self.abandoned.get(store.namespace)):
            return incoming
        if incoming is not None and incoming.version <= have and not thorough:
            return None
        newest = await store.published_version()
        if newest is None or newest <= have:
            return None
        try:
            return await store.manifest(newest)
        except WeightVersionError:
            return None  # deleted meanwhile: a newer one exists

    async def _copy(self, store: WeightStore, manifest: Manifest) -> tuple[str, Manifest]:
        """`manifest`'s version into a new segment of this host, from torchstore where the publisher put it there,
        else streamed from its host's SegmentServer; returns the segment's name and the publisher's manifest."""
        name = store.segment_name(manifest.version)
        self.server.own.add(name)  # other hosts' relays need no event for this host's copies
        try:
            writer = await asyncio.to_thread(create_segment, SHM_DIR / name, manifest.segment_size, manifest.version,
                                             store._spare_path())
        except SharedMemoryError as e:
            raise SharedMemoryError(f"weight relay on {self.host}: {e}") from None
        try:
            if manifest.in_torchstore:
                await self._pull_from_torchstore(store, manifest, writer)
            else:
                manifest = await self._stream(store, manifest, writer)
            await asyncio.to_thread(writer.commit)
        except BaseException:
            writer.abort()  # marks it abandoned: this host's readers of the copy stop at once
            raise
        return name, manifest

    async def _stream(self, store: WeightStore, manifest: Manifest, writer: SegmentWriter) -> Manifest:
        """Stream the version's segment from its host's SegmentServer into `writer`, its pieces readable on this host
        as they land; returns the publisher's final manifest (the checksums)."""
        arriving = store.host_incoming_key(self.host)
        await ts.put(arriving, dataclasses.replace(manifest, host=self.host, segment=writer.path.name))
        try:
            if manifest.host not in self.servers:
                await self._advertise_server()
            await asyncio.to_thread(receive_segment, tuple(self.servers[manifest.host]), manifest, writer,
                                    self.secret)
            self.last_copy["received"] = time.time()
            final = await store._published_manifest(manifest.version)
        except BaseException:
            with contextlib.suppress(Exception):  # this host's readers stop looking for it
                await ts.delete(arriving)
            raise
        if final.segment_size != writer.size:
            raise WeightVersionError(f"policy version {manifest.version}: its final manifest does not match the layout "
                                     "it was announced with")
        return final

    async def _pull_from_torchstore(self, store: WeightStore, manifest: Manifest, writer: SegmentWriter) -> None:
        prefix = store.tensors_key(manifest.version)
        gets = asyncio.Semaphore(_CONCURRENT_GETS)

        async def copy_one(tensor_name: str) -> None:
            async with gets:
                tensor = await ts.get(f"{prefix}/{tensor_name}")
                await asyncio.to_thread(writer.write, tensor.contiguous(), manifest.entries[tensor_name].offset)

        await asyncio.gather(*(copy_one(n) for n in manifest.entries))

    async def _delete_copies_the_trainer_deleted(self, store: WeightStore, keep: int) -> None:
        copies = self.copies.get(store.namespace, {})
        live = set(await store.versions())
        for version in [v for v in copies if v != keep and v not in live]:
            segment = copies.pop(version)
            self.server.own.discard(segment)
            await ts.delete(store.host_manifest_key(self.host, version))
            retire_segment(SHM_DIR / segment, store._spare_path())  # the next copy writes into it, as a publish does
