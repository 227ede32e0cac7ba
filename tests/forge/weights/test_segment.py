"""The shared-memory data plane in one process: versions written into reused files through the writer's mappings
of them stay exact and verified, and a deleted file's mapping does not outlive it. No Monarch, no torchstore."""

import dataclasses
import fcntl
import os
from pathlib import Path

import pytest
import torch

from forge.weights import checksums as weight_checksums, segment
from forge.job import job_id
from forge.weights.checksums import CHECKSUM, checksums
from forge.weights.manifest import Manifest, WeightChecksumError, WeightVersionError, layout
from forge.weights.segment import HEADER, RETIRED, SHM_DIR, WRITING, create_segment, map_segment, read_segment, retire_segment, segment_state, unlink_segment
from tests.support import flip_byte

SHAPES = {"embed": (64, 48), "norm": (48,), "odd": (1001,), "proj": (96, 48)}  # tensors of odd sizes, several pieces


@pytest.fixture
def small_pieces(monkeypatch):
    """Several checksum pieces and hash steps per tensor, as a 1 GB state dict has, on a small one."""
    monkeypatch.setattr(weight_checksums, "_CHUNK", 1000)
    monkeypatch.setattr(weight_checksums, "_HASH_STEP", 96)


class Publisher:
    """Publishes versions as WeightStore does with one version kept: version v is written into the file of
    version v-2 (the spare: deleted when v-1 was published) while version v-1 is still there to be read."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"forge-{job_id()}-{namespace}"
        self.spare = SHM_DIR / f"{self.prefix}-spare"
        self.published: dict[int, tuple[Manifest, dict[str, torch.Tensor]]] = {}
        self.writers: dict[int, segment.SegmentWriter] = {}

    def publish(self, version: int, shapes: dict[str, tuple[int, ...]] = SHAPES, hashed_while_written: bool = True
                ) -> Manifest:
        """`hashed_while_written`: as the publisher writes (write_checksummed); else as a relay copies a tensor it
        received (write), the checksums taken apart."""
        generator = torch.Generator().manual_seed(version)
        weights = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
        entries, size = layout(weights, None)
        writer = create_segment(SHM_DIR / f"{self.prefix}-v{version}", size, version, self.spare)
        for name, tensor in weights.items():
            if hashed_while_written:
                sums = writer.write_checksummed(tensor, entries[name].offset, CHECKSUM)
            else:
                writer.write(tensor, entries[name].offset)
                sums = checksums(tensor, CHECKSUM)
            entries[name] = dataclasses.replace(entries[name], checksums=sums)
        writer.commit()
        self.writers[version] = writer
        manifest = Manifest(version, "host", writer.path.name, False, entries, CHECKSUM)
        self.published[version] = manifest, weights
        return manifest

    def delete(self, version: int) -> None:
        """WeightStore.delete: the file becomes the spare, or is removed when there is one or a reader leases it."""
        retire_segment(SHM_DIR / self.published.pop(version)[0].segment, self.spare)

    def assert_exact(self, version: int) -> None:
        manifest, weights = self.published[version]
        read = read_segment(SHM_DIR / manifest.segment, manifest)
        for name, tensor in weights.items():
            assert torch.equal(read[name], tensor), (version, name)

    def remove_all(self) -> None:
        for path in SHM_DIR.glob(f"{self.prefix}-*"):
            unlink_segment(path)


@pytest.fixture
def publisher(request):
    made = Publisher(f"test-shm-{request.node.name[:40]}")
    yield made
    made.remove_all()


def deleted_files_mapped() -> list[str]:
    """This process's mappings of files that no longer exist (their memory is held until unmapped)."""
    return [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "forge-" in line and line.endswith("(deleted)")]


def test_versions_written_into_reused_files_through_kept_mappings_stay_exact_and_leave_the_kept_version_intact(
        publisher, small_pieces):
    for version in range(8):
        publisher.publish(version)
        if version >= 2:  # written into the spare, whose pages are all in place: through a mapping
            assert publisher.writers[version]._mappable, version
        publisher.assert_exact(version)
        if version >= 1:
            publisher.assert_exact(version - 1)  # the version still kept: not written into
            publisher.delete(version - 1)
    # the two files that alternate, each mapped once and kept (by inode: the names change at every publish)
    mapped = [m for m in segment._MAPPINGS.values() if publisher.prefix in os.readlink(f"/proc/self/fd/{m.fd}")]
    assert len(mapped) == 2


def test_whole_tensors_copied_into_a_reused_mapped_file_are_exact(publisher, small_pieces):
    """`write` (a relay's copy of a tensor it received) goes through the mapping in steps, the last one short."""
    for version in range(4):
        publisher.publish(version, hashed_while_written=False)
        publisher.assert_exact(version)
        if version:
            publisher.assert_exact(version - 1)
            publisher.delete(version - 1)
    assert publisher.writers[2]._mappable and publisher.writers[3]._mappable


def test_a_corrupted_byte_in_a_reused_mapped_segment_fails_the_read_naming_the_tensor_and_the_version(
        publisher, small_pieces):
    for version in range(3):
        publisher.publish(version)
        if version:
            publisher.delete(version - 1)
    manifest, _ = publisher.published[2]
    assert publisher.writers[2]._mappable
    flip_byte(SHM_DIR / manifest.segment, HEADER + manifest.entries["proj"].offset + 4321)
    with pytest.raises(WeightChecksumError, match=r"policy version 2: tensor 'proj' .*bytes 4000\.\.5000 of 9216.*"
                                                  r"corrupted tensors: \['proj'\]"):
        read_segment(SHM_DIR / manifest.segment, manifest)


def test_a_reused_file_that_must_grow_is_written_whole_and_exact(publisher, small_pieces):
    """A spare smaller than the new version (the model grew) has no pages for the
    new bytes: those go through pwrite, never through a mapping onto missing pages (SIGBUS on a full /dev/shm)."""
    bigger = {**SHAPES, "extra": (333, 7)}
    for version in range(3):
        publisher.publish(version)
        if version:
            publisher.delete(version - 1)
    publisher.publish(3, bigger)  # into version 1's file, which is smaller
    assert not publisher.writers[3]._mappable
    publisher.assert_exact(2)
    publisher.assert_exact(3)
    publisher.delete(2)
    publisher.publish(4, bigger)  # into version 2's file: smaller too
    publisher.delete(3)
    publisher.publish(5, bigger)  # into version 3's, which has every page now: mapped (its mapping's size changed)
    assert publisher.writers[5]._mappable
    publisher.assert_exact(4)
    publisher.assert_exact(5)


def test_a_deleted_segment_is_no_longer_mapped_by_its_writer(publisher):
    for version in range(4):
        publisher.publish(version)
        if version:
            publisher.delete(version - 1)
    # version 3 lives in version 1's file, the spare is version 2's (in version 0's): both mapped by this process
    assert publisher.writers[3]._mappable and publisher.writers[2]._mappable and deleted_files_mapped() == []
    unlink_segment(SHM_DIR / publisher.published.pop(3)[0].segment)  # as WeightStore.delete when a spare exists
    assert deleted_files_mapped() == []
    publisher.spare.unlink()  # by another process (a relay, a cleanup): this one's mapping holds its memory
    assert len(deleted_files_mapped()) == 1
    publisher.publish(4)  # until its next publish
    assert deleted_files_mapped() == []


# --- readers that take views of a segment (map_segment) ---------------------------------------------------------
def test_a_mapped_version_is_exact_and_its_lease_keeps_its_file_from_being_rewritten(publisher, small_pieces):
    publisher.publish(0)
    manifest, weights = publisher.published[0]
    views = map_segment(SHM_DIR / manifest.segment, manifest)
    assert all(torch.equal(views[name], tensor) for name, tensor in weights.items())
    publisher.publish(1)
    publisher.delete(0)  # leased: deleted, not made the spare
    assert not publisher.spare.exists() and deleted_files_mapped() == [f"{SHM_DIR / manifest.segment} (deleted)"]
    for version in range(2, 6):  # versions written into the files of unleased ones, around the leased one's pages
        publisher.publish(version)
        publisher.delete(version - 1)
    assert publisher.spare.exists()
    assert all(torch.equal(views[name], tensor) for name, tensor in weights.items())
    del views  # the reader drops the version: the lease and the memory go with its last view
    assert deleted_files_mapped() == []


def test_a_write_to_a_mapped_tensor_stays_in_the_reader_s_own_copy_of_the_page(publisher, small_pieces):
    manifest = publisher.publish(0)
    views = map_segment(SHM_DIR / manifest.segment, manifest)
    views["proj"].fill_(3.0)
    publisher.assert_exact(0)  # the file still holds what was published
    assert torch.equal(map_segment(SHM_DIR / manifest.segment, manifest)["proj"], publisher.published[0][1]["proj"])


def test_a_corrupted_byte_fails_the_mapped_read_naming_the_tensor_and_the_version(publisher, small_pieces):
    manifest = publisher.publish(0)
    flip_byte(SHM_DIR / manifest.segment, HEADER + manifest.entries["odd"].offset + 1500)
    with pytest.raises(WeightChecksumError, match=r"policy version 0: tensor 'odd' .*bytes 1000\.\.2000 of 2002.*"
                                                  r"corrupted tensors: \['odd'\]"):
        map_segment(SHM_DIR / manifest.segment, manifest)


def test_a_segment_being_retired_or_retired_is_refused_by_a_mapping_reader(publisher, monkeypatch):
    manifest = publisher.publish(0)
    path = SHM_DIR / manifest.segment
    retiring = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(retiring, fcntl.LOCK_EX)  # retire_segment's hold while it makes the file the spare
        with pytest.raises(WeightVersionError, match="policy version 0 was deleted while being fetched"):
            map_segment(path, manifest)
    finally:
        os.close(retiring)
    opened_before = os.open(path, os.O_RDONLY)  # a reader that opened the file just before it was retired
    try:
        publisher.delete(0)
        assert publisher.spare.exists() and segment_state(opened_before)[:2] == (RETIRED, WRITING)
        # ... and takes its lease only now: the header tells it the file is no longer version 0's
        monkeypatch.setattr(segment, "open_segment_file", lambda *_, **__: os.dup(opened_before))
        with pytest.raises(WeightVersionError, match=r"policy version 0 was deleted while being fetched \(forge-"):
            map_segment(path, manifest)
    finally:
        os.close(opened_before)
