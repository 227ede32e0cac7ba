"""The relay's data path in one process, over a real socket: a version streamed from its publisher's segment while
it is being written, received into another host's segment, read there as it lands (forge/weights/relay.py,
forge/weights/segment.py); and the server's handshake: a client without the job's secret gets no byte of a segment and
no event, and one that stays silent is dropped without holding up the others. The same path across simulated hosts
is in tests/forge/test_multihost.py."""

import dataclasses
import errno
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from forge import job_auth
from forge.weights import relay as weight_relay
from forge.weights import checksums as weight_checksums, segment
from forge.job import job_id
from forge.weights.checksums import piece_ends
from forge.weights.manifest import Manifest, SharedMemoryError, WeightChecksumError, WeightVersionError, layout
from forge.weights.segment import HEADER, SHM_DIR, SegmentRead, create_segment, segment_state
from forge.job_auth import JobAuthenticationError
from forge.weights.relay import SegmentServer, connect, receive_segment

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)

SECRET = b"0123456789abcdef" * 4  # the job's secret in these tests (forge.job_auth.job_secret in a job)


@pytest.fixture(scope="module")
def server():
    return SegmentServer("127.0.0.1", SECRET)


@pytest.fixture
def weights():
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(50_000 + i, generator=generator).to(torch.bfloat16) for i in range(6)}


class Publisher:
    """Writes `weights` as `version` into host A's segment one tensor at a time, pausing after tensor `pause_after`
    until `go` is set; `finish` commits (or abandons) and returns the final manifest."""

    def __init__(self, weights: dict, version: int, name: str) -> None:
        self.weights, self.version = weights, version
        self.entries, size = layout(weights, None)
        self.writer = create_segment(SHM_DIR / f"forge-{job_id()}-{name}-v{version}", size, version, None)
        self.announced = Manifest(version, "A", self.writer.path.name, False, self.entries, weight_checksums.CHECKSUM)

    def write(self, names: list[str]) -> None:
        for name in names:
            sums = self.writer.write_checksummed(self.weights[name], self.entries[name].offset, weight_checksums.CHECKSUM)
            self.entries[name] = dataclasses.replace(self.entries[name], checksums=sums)

    def commit(self) -> Manifest:
        self.writer.commit()
        return dataclasses.replace(self.announced, entries=dict(self.entries))


class Relay(threading.Thread):
    """Host B's side: receives the announced version into a new segment, commits it, or abandons it on failure."""

    def __init__(self, server: SegmentServer, announced: Manifest, name: str) -> None:
        super().__init__(daemon=True)
        self.server, self.announced, self.error = server, announced, None
        self.writer = create_segment(SHM_DIR / f"forge-{job_id()}-{name}-v{announced.version}",
                                     announced.segment_size, announced.version, None)
        self.copy = dataclasses.replace(announced, host="B", segment=self.writer.path.name)

    def run(self) -> None:
        try:
            receive_segment(self.server.address, self.announced, self.writer, SECRET)
            self.writer.commit()
        except BaseException as error:
            self.error = error
            self.writer.abort()


class Reader(threading.Thread):
    def __init__(self, copy: Manifest) -> None:
        super().__init__(daemon=True)
        self.copy, self.read, self.error = copy, None, None
        self.start()

    def run(self) -> None:
        try:
            self.read = SegmentRead(SHM_DIR / self.copy.segment, self.copy, None, arriving=True)
        except BaseException as error:
            self.error = error


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _descriptors_of(path) -> int:
    """How many of this process's open file descriptors point at `path`."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path))


def _ready_bytes(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return segment_state(fd)[2]
    finally:
        os.close(fd)


def test_a_version_streamed_while_written_is_read_as_it_lands_and_returned_only_once_complete(server, weights):
    publisher = Publisher(weights, 1, "stream")
    relay = Relay(server, publisher.announced, "stream-b")
    relay.start()
    reader = Reader(relay.copy)
    names = list(weights)
    try:
        publisher.write(names[:3])
        first_three = publisher.entries[names[2]].offset + publisher.entries[names[2]].nbytes
        # Half the version crossed to host B and is marked ready there while the publisher is still writing ...
        _until(lambda: _ready_bytes(relay.writer.tmp) == first_three)
        time.sleep(0.2)
        # ... but neither the relay nor the reader returned a half-written version.
        assert relay.is_alive() and reader.is_alive() and reader.read is None
        publisher.write(names[3:])
        final = publisher.commit()
        relay.join(10)
        reader.join(10)
        assert relay.error is None and reader.error is None, (relay.error, reader.error)
        fetched = reader.read.verified(final)
        assert all(torch.equal(fetched[name], tensor) for name, tensor in weights.items())
        assert relay.writer.path.exists() and not relay.writer.tmp.exists()
    finally:
        for path in (publisher.writer.path, relay.writer.path):
            path.unlink(missing_ok=True)


def test_a_version_abandoned_mid_stream_fails_its_relay_and_its_readers_and_leaves_no_segment(server, weights):
    publisher = Publisher(weights, 2, "abandoned")
    relay = Relay(server, publisher.announced, "abandoned-b")
    relay.start()
    reader = Reader(relay.copy)
    publisher.write(list(weights)[:2])
    _until(lambda: _ready_bytes(relay.writer.tmp) > 0)
    publisher.writer.abort()  # what a failed publish does
    relay.join(10)
    reader.join(10)
    assert isinstance(relay.error, ConnectionError), relay.error
    assert isinstance(reader.error, WeightVersionError) and "abandoned" in str(reader.error), reader.error
    assert reader.read is None
    assert not any(p.exists() for p in (publisher.writer.tmp, publisher.writer.path, relay.writer.tmp,
                                        relay.writer.path))


def test_bytes_that_differ_from_the_published_checksums_are_refused_naming_the_tensor(server, weights):
    publisher = Publisher(weights, 3, "corrupt")
    publisher.write(list(weights))
    final = publisher.commit()
    entry = final.entries["t4"]
    with open(publisher.writer.path, "r+b") as segment:  # host A's copy changed after it was checksummed
        segment.seek(HEADER + entry.offset + 101)
        byte = segment.read(1)
        segment.seek(HEADER + entry.offset + 101)
        segment.write(bytes([byte[0] ^ 0x10]))
    relay = Relay(server, final, "corrupt-b")
    try:
        relay.start()
        relay.join(10)
        assert relay.error is None
        read = SegmentRead(relay.writer.path, relay.copy, None, arriving=True)
        with pytest.raises(WeightChecksumError, match=r"policy version 3: tensor 't4' does not match.*\['t4'\]"):
            read.verified(final)
    finally:
        for path in (publisher.writer.path, relay.writer.path):
            path.unlink(missing_ok=True)


def test_a_reader_gives_up_when_no_byte_arrives_for_the_stall_limit(weights, monkeypatch):
    monkeypatch.setattr(segment, "ARRIVAL_STALL_S", 0.5)
    publisher = Publisher(weights, 4, "stalled")
    try:
        publisher.write(list(weights)[:1])  # then its writer stops, as a killed process does: no commit, no abort
        started = time.monotonic()
        with pytest.raises(WeightVersionError, match=r"policy version 4: no byte of it arrived .* for 0 s"):
            SegmentRead(publisher.writer.path, publisher.announced, None, arriving=True)
        assert time.monotonic() - started < 5
    finally:
        publisher.writer.abort()


def test_ready_never_covers_a_gap_and_moves_over_pieces_written_out_of_order_once_it_is_filled(weights):
    publisher = Publisher(weights, 5, "order")
    try:
        first, second = list(weights)[:2]
        publisher.write([second])
        assert _ready_bytes(publisher.writer.tmp) == 0
        publisher.write([first])
        entry = publisher.entries[second]
        assert _ready_bytes(publisher.writer.tmp) == entry.offset + entry.nbytes
    finally:
        publisher.writer.abort()


def test_a_full_shared_memory_on_host_b_fails_the_copy_naming_the_version_and_its_readers_stop(server, weights,
                                                                                                monkeypatch):
    real_splice = os.splice

    def splice_into_a_full_dev_shm(source: int, target: int, count: int, offset_src=None, offset_dst=None):
        if offset_dst is not None:  # the write into host B's segment, not the read from the socket
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_splice(source, target, count, offset_src, offset_dst)

    monkeypatch.setattr(weight_relay.os, "splice", splice_into_a_full_dev_shm)
    publisher = Publisher(weights, 6, "full")
    relay = Relay(server, publisher.announced, "full-b")
    reader = Reader(relay.copy)
    try:
        # The reader holds the copy open before the relay fails (else it finds the copy already removed: "deleted").
        _until(lambda: _descriptors_of(relay.writer.tmp) >= 2)  # the relay's writer's and the reader's
        relay.start()
        publisher.write(list(weights))
        publisher.commit()
        relay.join(10)
        reader.join(10)
        assert isinstance(relay.error, SharedMemoryError) and "policy version 6" in str(relay.error), relay.error
        assert "No space left" in str(relay.error)
        assert isinstance(reader.error, WeightVersionError) and "abandoned" in str(reader.error), reader.error
        assert not relay.writer.tmp.exists() and not relay.writer.path.exists()
    finally:
        publisher.writer.path.unlink(missing_ok=True)


def test_pieces_are_marked_ready_where_the_pieces_readers_read_end(monkeypatch):
    monkeypatch.setattr(weight_checksums, "_CHUNK", 1024)
    entries, _ = layout({"big": torch.zeros(1250, dtype=torch.bfloat16), "small": torch.zeros(3)}, None)
    manifest = Manifest(1, "A", None, False, entries, weight_checksums.CHECKSUM)
    # "big" is 2500 bytes (pieces 0-1024, 1024-2048, 2048-2500); "small" (12 bytes) starts 64-byte aligned at 2560.
    assert piece_ends(manifest) == [1024, 2048, 2500, 2572] and manifest.segment_size == 2572
    reader_pieces = [(entry.offset + start, entry.offset + start + len(view)) for entry in entries.values()
                     for start, view in zip(range(0, entry.nbytes, 1024),
                                            weight_checksums._chunks(memoryview(bytes(entry.nbytes))))]
    assert [end for _, end in reader_pieces] == piece_ends(manifest)


def test_the_server_tells_watchers_when_a_segment_starts_completes_and_goes_but_not_of_its_own_copies(server, weights):
    with connect(server.address, SECRET, timeout=10) as watcher:
        watcher.sendall(b"watch\n")
        lines = watcher.makefile("rb")
        time.sleep(0.2)  # the server follows its folder from the first watcher on
        server.own.add(f"forge-{job_id()}-events-own-v1")  # a copy its own relay writes: nobody else needs to know
        own = create_segment(SHM_DIR / f"forge-{job_id()}-events-own-v1", 64, 1, None)
        own.commit()
        publisher = Publisher(weights, 7, "events")
        publisher.write(list(weights))
        publisher.commit()
        publisher.writer.path.unlink()  # deleted by the trainer
        (SHM_DIR / f"forge-{job_id()}-events-own-v1").unlink()
        got = [lines.readline().decode().strip() for _ in range(3)]
        watcher.settimeout(0.5)
        with pytest.raises(TimeoutError):  # and nothing of its own copy's deletion
            lines.readline()
    assert got == ["started events 7", "changed events 7", "changed events 7"]  # created, committed, deleted


# -- who the server serves -----------------------------------------------------------------------------------------

_HELLO_BYTES = len(weight_relay._HELLO) + job_auth.NONCE_BYTES  # all a client without the secret ever gets


def _everything_sent_to(connection: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the server sends on `connection` until it closes it (fails if it is still open after `timeout_s`)."""
    connection.settimeout(timeout_s)
    received = b""
    while chunk := connection.recv(1 << 16):
        received += chunk
    return received


def test_a_client_without_the_jobs_secret_gets_no_byte_of_a_segment_and_no_event(server, weights):
    publisher = Publisher(weights, 8, "guarded")
    publisher.write(list(weights))
    publisher.commit()
    segment = publisher.writer.path.name
    try:
        # The protocol without a handshake (what any `nc host port` sends): a segment's name, or `watch` and a
        # segment created meanwhile (an event for a watcher).
        for request in (segment.encode() + b"\n", b"watch\n"):
            with socket.create_connection(server.address, timeout=10) as impostor:
                impostor.sendall(request.ljust(job_auth.NONCE_BYTES + job_auth.MAC_BYTES, b"\n"))
                create_segment(SHM_DIR / f"forge-{job_id()}-guarded-v9", 64, 9, None).commit()
                got = _everything_sent_to(impostor)
                (SHM_DIR / f"forge-{job_id()}-guarded-v9").unlink()
            assert got.startswith(weight_relay._HELLO) and len(got) == _HELLO_BYTES, got[:80]
        # A well-formed handshake under another secret: refused, and it learns nothing more.
        with pytest.raises(JobAuthenticationError, match="refused this process's proof of the job's secret"):
            connect(server.address, b"another job's secret".ljust(64, b"!"), timeout=10)
        with socket.create_connection(server.address, timeout=10) as impostor:
            hello = impostor.recv(_HELLO_BYTES, socket.MSG_WAITALL)
            nonce = os.urandom(job_auth.NONCE_BYTES)
            wrong = job_auth.proof(b"a guess".ljust(64), b"client", hello[len(weight_relay._HELLO):], nonce)
            impostor.sendall(nonce + wrong)
            assert _everything_sent_to(impostor) == b""
        # The same request with the secret is served: the refusals above were the handshake's.
        with connect(server.address, SECRET, timeout=10) as relay:
            relay.sendall(segment.encode() + b"\n")
            assert len(_everything_sent_to(relay)) == 8 + publisher.writer.size + HEADER
    finally:
        publisher.writer.path.unlink(missing_ok=True)


def test_a_silent_client_is_dropped_after_the_handshake_timeout_and_holds_up_no_other(server, weights, monkeypatch):
    monkeypatch.setattr(job_auth, "HANDSHAKE_TIMEOUT_S", 0.5)
    silent = [socket.create_connection(server.address, timeout=10) for _ in range(16)]
    try:
        publisher = Publisher(weights, 10, "beside-silent")
        relay = Relay(server, publisher.announced, "beside-silent-b")
        relay.start()  # while 16 clients that never answer the challenge hold connections
        publisher.write(list(weights))
        final = publisher.commit()
        relay.join(10)
        assert relay.error is None, relay.error
        read = SegmentRead(relay.writer.path, relay.copy, None, arriving=True).verified(final)
        assert all(torch.equal(read[name], tensor) for name, tensor in weights.items())
        for connection in silent:  # each got the challenge, then the end of its connection (not the test's 10 s)
            assert len(_everything_sent_to(connection)) == _HELLO_BYTES
    finally:
        for connection in silent:
            connection.close()
        for path in (publisher.writer.path, relay.writer.path):
            path.unlink(missing_ok=True)


def test_a_client_refuses_a_server_that_does_not_hold_the_secret():
    """The handshake goes both ways: a process posing as a segment server cannot feed a relay."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def accept_any_proof() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.sendall(weight_relay._HELLO + os.urandom(job_auth.NONCE_BYTES))
                connection.recv(job_auth.NONCE_BYTES + job_auth.MAC_BYTES, socket.MSG_WAITALL)
                connection.sendall(bytes(job_auth.MAC_BYTES))
                connection.recv(1)

        threading.Thread(target=accept_any_proof, daemon=True).start()
        with pytest.raises(JobAuthenticationError, match="does not hold this job's secret"):
            connect(listener.getsockname()[:2], SECRET, timeout=10)


def test_the_server_listens_on_the_address_it_is_given_and_never_on_every_interface(server):
    assert server.address[0] == "127.0.0.1"
    with pytest.raises(ValueError, match="'0.0.0.0': listen on this host's own address"):
        SegmentServer("0.0.0.0", SECRET)
