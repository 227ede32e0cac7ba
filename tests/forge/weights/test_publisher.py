"""The weight plane as a package: a publish whose pieces are written and hashed on several threads stays bit-exact,
names a corrupted piece, and never marks a piece ready before its hash exists; the device-copy path (the segment as
the copy's target) on CPU; the runtime below imports none of the plane and runs the clean-up it registers; the old
module names still import, with a DeprecationWarning. No Monarch, no torchstore."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch

from forge import job
from forge.job import job_id
from forge.weights import checksums as weight_checksums
from forge.weights import segment
from forge.weights.checksums import CHECKSUM, checksums
from forge.weights.manifest import Manifest, WeightChecksumError, layout
from forge.weights.publisher import PieceWriter
from forge.weights.segment import HEADER, SHM_DIR, create_segment, read_segment, unlink_segment
from tests.support import flip_byte

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)

SHAPES = {"embed": (300, 40), "norm": (40,), "odd": (1001,), "proj": (200, 40)}


@pytest.fixture
def small_pieces(monkeypatch):
    """Many pieces per tensor, as a 1 GB state dict has, on a small one."""
    monkeypatch.setattr(weight_checksums, "_CHUNK", 1000)
    monkeypatch.setattr(weight_checksums, "_HASH_STEP", 96)


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in SHAPES.items()}


def publish(name: str, version: int, tensors: dict[str, torch.Tensor], threads: int, spare=None,
            device_copy: bool | None = None) -> Manifest:
    entries, size = layout(tensors, None)
    writer = create_segment(SHM_DIR / f"forge-{job_id()}-{name}-v{version}", size, version, spare)
    pieces = PieceWriter(writer, CHECKSUM, threads=threads, max_pending=3000)
    for tensor_name, tensor in tensors.items():
        if device_copy is None:
            pieces.add(tensor_name, tensor, entries[tensor_name].offset)
        else:  # the device path's lines on a CPU tensor: copy_ into the segment, then hash the segment's bytes
            nbytes = tensor.numel() * tensor.element_size()
            sums = tuple(writer.write_piece(tensor, entries[tensor_name].offset, start,
                                            min(start + weight_checksums._CHUNK, nbytes), CHECKSUM,
                                            device_copy=device_copy)
                         for start in range(0, nbytes, weight_checksums._CHUNK))
            entries[tensor_name] = dataclasses.replace(entries[tensor_name], checksums=sums)
    if device_copy is None:
        sums = pieces.finish()
        entries = {n: dataclasses.replace(e, checksums=sums[n]) for n, e in entries.items()}
    writer.commit()
    return Manifest(version, "host", writer.path.name, False, entries, CHECKSUM)


def test_a_threaded_publish_is_bit_exact_and_its_checksums_are_the_sequential_ones(small_pieces):
    tensors = weights(1)
    manifest = publish("threaded", 1, tensors, threads=3)
    try:
        for name, tensor in tensors.items():
            assert manifest.entries[name].checksums == checksums(tensor, CHECKSUM)
        read = read_segment(SHM_DIR / manifest.segment, manifest)
        assert all(torch.equal(read[n].view(torch.int16), t.view(torch.int16)) for n, t in tensors.items())
    finally:
        unlink_segment(SHM_DIR / manifest.segment)


def test_a_corrupted_piece_of_a_threaded_publish_is_named(small_pieces):
    tensors = weights(2)
    manifest = publish("corrupt", 2, tensors, threads=3)
    try:
        entry = manifest.entries["proj"]
        flip_byte(SHM_DIR / manifest.segment, HEADER + entry.offset + 2500)  # its third piece
        with pytest.raises(WeightChecksumError, match=r"tensor 'proj' .*bytes 2000\.\.3000 .*corrupted tensors: \['proj'\]"):
            read_segment(SHM_DIR / manifest.segment, manifest)
    finally:
        unlink_segment(SHM_DIR / manifest.segment)


def test_no_piece_is_marked_ready_before_its_hash_is_taken_whatever_order_the_threads_finish_in(small_pieces,
                                                                                              monkeypatch):
    hashed: set[tuple[int, int]] = set()
    current = threading.local()
    marks: list[int] = []
    real_write_piece, real_mark = segment.SegmentWriter.write_piece, segment.SegmentWriter.mark_ready

    class SlowHasher(segment._Hasher):
        def digest(self) -> int:
            time.sleep(0.002 * (hash(current.piece) % 3))  # pieces finish out of order
            value = super().digest()
            hashed.add(current.piece)
            return value

    def write_piece(self, tensor, offset, start, end, algorithm, **kwargs):
        current.piece = (offset + start, offset + end)
        return real_write_piece(self, tensor, offset, start, end, algorithm, **kwargs)

    def mark_ready(self, nbytes: int) -> None:
        pieces = {piece for piece in expected if piece[1] <= nbytes}
        assert pieces <= hashed, f"ready={nbytes} covers pieces not yet hashed: {sorted(pieces - hashed)[:3]}"
        marks.append(nbytes)
        real_mark(self, nbytes)

    monkeypatch.setattr(segment, "_Hasher", SlowHasher)
    monkeypatch.setattr(segment.SegmentWriter, "write_piece", write_piece)
    monkeypatch.setattr(segment.SegmentWriter, "mark_ready", mark_ready)
    tensors = weights(3)
    entries, _ = layout(tensors, None)
    expected = {(e.offset + s, e.offset + min(s + 1000, e.nbytes)) for e in entries.values() for s in range(0, e.nbytes, 1000)}
    manifest = publish("order", 3, tensors, threads=4)
    try:
        assert marks == sorted(marks) and marks[-1] == manifest.segment_size  # forward only, and all of it
        assert len(marks) > 1  # ready moved while pieces were still being written
    finally:
        unlink_segment(SHM_DIR / manifest.segment)


@pytest.mark.parametrize("reused", [False, True])
def test_the_device_copy_path_writes_into_the_segment_itself_and_hashes_what_landed(small_pieces, reused):
    """The lines a GPU tensor takes (copy_ into the segment's mapping, then the hash of the segment's bytes), run on a
    CPU tensor: into a reused file's mapping (the DMA target), or through host memory into a fresh file."""
    spare = SHM_DIR / f"forge-{job_id()}-device-spare"
    if reused:
        publish("device", 9, weights(9), threads=1)
        (SHM_DIR / f"forge-{job_id()}-device-v9").rename(spare)
    tensors = weights(4)
    manifest = publish("device", 4, tensors, threads=1, spare=spare if reused else None, device_copy=True)
    try:
        for name, tensor in tensors.items():
            assert manifest.entries[name].checksums == checksums(tensor, CHECKSUM)
        read = read_segment(SHM_DIR / manifest.segment, manifest)
        assert all(torch.equal(read[n].view(torch.int16), t.view(torch.int16)) for n, t in tensors.items())
        writer = segment.SegmentWriter(SHM_DIR / f"forge-{job_id()}-device-v5", 64, 5, None)
        assert writer.pin_for_device() is (torch.cuda.is_available() and writer._mappable)
        writer.abort()
    finally:
        unlink_segment(SHM_DIR / manifest.segment)
        unlink_segment(spare)


def test_the_runtime_imports_none_of_the_weight_plane():
    runtime = ["forge.job", "forge.processes", "forge.provisioner", "forge.hosts.agent", "forge.hosts.host_mesh",
               "forge.hosts.config", "forge.lifecycle"]
    code = ("import sys, importlib\n"
            f"for name in {runtime!r}: importlib.import_module(name)\n"
            "plane = sorted(m for m in sys.modules if m.startswith('forge.weights') or m in ("
            "'forge.shm_weights', 'forge.weight_store', 'forge.weight_relay'))\n"
            "print(plane)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_runtime_runs_the_clean_up_a_plane_registered(monkeypatch):
    monkeypatch.setattr(job, "_cleanups", {})
    monkeypatch.setattr(job, "_started", True)  # a controller already started: the dead jobs' sweep runs at once
    calls: list[str] = []
    job.register_cleanup("things", lambda: calls.append("this job"), lambda: calls.append("dead jobs"))
    assert calls == ["dead jobs"]
    job.register_cleanup("broken", lambda: 1 / 0)  # logged; the others still run
    job.cleanup()
    assert calls == ["dead jobs", "this job"] and job.registered() == ["broken", "things"]


def test_importing_the_segments_registers_their_clean_up_with_the_runtime():
    assert "shared-memory segments" in job.registered()
    path = SHM_DIR / f"forge-{job_id()}-cleanup-v1"
    path.write_bytes(b"x")
    job.cleanup()
    assert not path.exists()


@pytest.mark.parametrize("old, new", [("forge.shm_weights", "forge.weights.segment"),
                                      ("forge.weight_store", "forge.weights.store"),
                                      ("forge.weight_relay", "forge.weights.relay")])
def test_the_old_module_names_import_with_a_deprecation_warning(old, new):
    code = (f"import warnings\nwith warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n    import {old} as old\n"
            f"import {new} as new\n"
            "print([str(w.message) for w in caught if w.category is DeprecationWarning and 'is deprecated' in str(w.message)])\n"
            "print(all(getattr(old, k) is v for k, v in vars(new).items() if not k.startswith('__')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    warned, same = result.stdout.strip().splitlines()[-2:]
    assert f"{old} is deprecated: use {new}" in warned and same == "True"


async def test_a_relayed_reader_is_told_of_a_version_only_once_its_host_can_read_it(monkeypatch):
    """One path: `latest_version` names a version only once this host's relay holds it or streams it in; a fetch of
    one only published on another host fails at once (no retry loop), and `wait_for_version` waits for the notice."""
    from forge.weights import store as store_module

    keys: dict[str, object] = {}

    async def get_if_exists(key: str):
        return keys.get(key)

    monkeypatch.setattr(store_module, "get_if_exists", get_if_exists)
    store = store_module.WeightStore("notice")
    store.relayed, store.host = True, "B"
    entries, _ = layout(weights(5), None)
    published = Manifest(7, "A", f"forge-{job_id()}-notice-v7", False, entries, CHECKSUM)
    keys.update({store._latest_key(): 7, store._manifest_key(7): published})
    assert await store.latest_version() is None  # published on host A only: nothing readable on B
    started = time.monotonic()
    with pytest.raises(store_module.WeightVersionError, match="not readable on host 'B' yet"):
        await store.fetch(7)
    with pytest.raises(store_module.WeightVersionError, match="has not reached host 'B'"):
        await store.wait_for_version(7, timeout_s=0.05, poll_s=0.01)
    assert time.monotonic() - started < 2
    waiting = asyncio.ensure_future(store.wait_for_version(7, timeout_s=10, poll_s=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    keys[store.host_incoming_key("B")] = dataclasses.replace(published, host="B")  # B's relay streams it in
    assert await asyncio.wait_for(waiting, 5) == 7
    assert await store._locate(7) == (keys[store.host_incoming_key("B")], True)
    monkeypatch.setattr(store_module, "UNPUBLISHED_WAIT_S", 0.02)
    with pytest.raises(store_module.WeightVersionError, match="needs policy version >= 8, but the newest published is 7"):
        await store.wait_for_version(8, poll_s=0.01)  # neither published nor being published
