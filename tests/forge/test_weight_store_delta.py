"""Delta sync through the weight store (issue 32): versions published as deltas where that is smaller, rebuilt
bit for bit by every reader on its own copy, on the host path (shared memory) and through torchstore."""

import dataclasses

import pytest
import torch

from forge.weights import delta as weight_delta
from forge.weights.checksums import checksums
from forge.weights.manifest import WeightChecksumError
from forge.weights.segment import HEADER
from forge.weights.delta_sync import DeltaSync
from forge.weights.store import SHM_DIR, WeightStore, WeightVersionError, ts
from tests.support import flip_byte
from forge.weights.startup import start_weight_store

NAMES = ("embed", "layer.q", "layer.k", "norm", "head")


@pytest.fixture(scope="module")
async def torchstore():
    await start_weight_store()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def _first() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (64, 48), "layer.q": (48, 48), "layer.k": (48, 16), "norm": (48,), "head": (300, 48)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _step(master: dict[str, torch.Tensor], version: int, *, everything: tuple[str, ...] = (),
          frozen: tuple[str, ...] = ()) -> None:
    """An fp32 master update that moves few bf16 values (most stay under a rounding boundary), every value of the
    tensors in `everything`, and none of the tensors in `frozen`."""
    g = torch.Generator().manual_seed(version)
    for name, tensor in master.items():
        if name in frozen:
            continue
        scale = 1.0 if name in everything else 3e-4
        tensor.add_(torch.randn(tensor.shape, generator=g) * scale * tensor.abs())


def _published(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(torch.bfloat16) for name, tensor in master.items()}


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], context: str) -> None:
    assert set(got) == set(want), context
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(_bits(got[name]), _bits(tensor)), f"{context}: {name}"


async def test_readers_rebuild_every_version_bit_for_bit_over_chains_of_deltas(torchstore):
    """One reader follows every version, one skips versions, one restarts for each fetch: all hold exactly what
    was published. Versions between the full ones are stored as deltas, much smaller than the tensors."""
    publisher = WeightStore("delta-chain", delta=DeltaSync(enabled=True, full_every=4))
    every, skipping = WeightStore("delta-chain"), WeightStore("delta-chain")
    master, published, manifests = _first(), {}, {}
    for version in range(10):
        if version:
            _step(master, version, everything=("norm",) if version == 5 else (),
                  frozen=("layer.k",) if version == 6 else ())
        published[version] = _published(master)
        manifests[version] = await publisher.publish(master, version, dtype=torch.bfloat16)
        _assert_bit_identical(await every.fetch(version), published[version], f"every, v{version}")
        if version % 3 == 0:
            _assert_bit_identical(await skipping.fetch(version), published[version], f"skipping, v{version}")
        restarted = WeightStore("delta-chain")
        _assert_bit_identical(await restarted.fetch(version), published[version], f"restarted, v{version}")
    assert [v for v, m in manifests.items() if m.base is None] == [0, 4, 8]  # a full version every 4
    for version in (1, 2, 3, 5, 6, 7, 9):
        manifest = manifests[version]
        assert (manifest.base, manifest.anchor) == (version - 1, version // 4 * 4)
        assert manifest.nbytes < manifest.tensor_nbytes / 2, (version, manifest.nbytes)
    # version 5 changed every value of `norm`: that tensor is stored whole, the others as deltas
    assert manifests[5].entries["norm"].encoding == "full"
    assert {manifests[5].entries[n].encoding for n in NAMES if n != "norm"} <= {"sparse", "bitmask"}
    # version 6 left `layer.k` as it was: an empty delta
    assert (manifests[6].entries["layer.k"].changed, manifests[6].entries["layer.k"].nbytes) == (0, 0)
    into = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in published[9].items()}  # fp32 receivers
    got = await every.fetch(9, into=into)
    assert all(got[name] is into[name] and torch.equal(into[name], t.float()) for name, t in published[9].items())
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_a_reader_behind_the_kept_chain_reads_the_newest_full_version(torchstore, monkeypatch):
    publisher = WeightStore("delta-behind", delta=DeltaSync(enabled=True, full_every=3))
    reader = WeightStore("delta-behind")
    master = _first()
    await publisher.publish(master, 0, dtype=torch.bfloat16)
    _step(master, 1)
    await publisher.publish(master, 1, dtype=torch.bfloat16)
    await reader.fetch(1)  # the reader holds version 1 of the chain that starts at 0
    for version in (2, 3, 4):
        _step(master, version)
        await publisher.publish(master, version, dtype=torch.bfloat16)
        await publisher.delete_older_than(version)  # keep_versions=1: but the chain version 4 needs stays
    assert await publisher.versions() == [3, 4]  # 3 is full (every 3), 4 a delta on it
    applied = []
    real_apply = WeightStore._apply

    async def spy(self, manifest, arriving):
        applied.append((manifest.version, manifest.base))
        await real_apply(self, manifest, arriving)

    monkeypatch.setattr(WeightStore, "_apply", spy)
    _assert_bit_identical(await reader.fetch(4), _published(master), "behind")
    assert applied == [(3, None), (4, 3)]  # the full version, then the delta on it
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_a_missing_link_asks_for_a_full_version_and_the_next_one_is_full(torchstore):
    publisher = WeightStore("delta-missing", delta=DeltaSync(enabled=True, full_every=8))
    reader = WeightStore("delta-missing")
    master = _first()
    for version in range(4):
        _step(master, version)
        await publisher.publish(master, version, dtype=torch.bfloat16)
        if version == 1:
            await reader.fetch(1)
    await publisher.delete(2)  # a link between what the reader holds and version 3
    with pytest.raises(WeightVersionError, match="policy version 2 is not in the weight store"):
        await reader.fetch(3)
    _step(master, 4)
    manifest = await publisher.publish(master, 4, dtype=torch.bfloat16)
    assert (manifest.base, manifest.anchor) == (None, 4)  # the reader's request: a full version
    _assert_bit_identical(await reader.fetch(4), _published(master), "after the full version")
    for version in await publisher.versions():
        await publisher.delete(version)


async def _delta_version(namespace: str) -> tuple[WeightStore, WeightStore, dict[str, torch.Tensor], object]:
    """A publisher and a reader holding version 0; version 1 published as deltas (returned with its manifest)."""
    publisher, reader = WeightStore(namespace, delta=DeltaSync(enabled=True)), WeightStore(namespace)
    master = _first()
    await publisher.publish(master, 0, dtype=torch.bfloat16)
    await reader.fetch(0)
    _step(master, 1)
    manifest = await publisher.publish(master, 1, dtype=torch.bfloat16)
    assert manifest.entries["head"].encoding in ("sparse", "bitmask")
    return publisher, reader, _published(master), manifest


async def test_a_corrupted_delta_in_shared_memory_fails_the_fetch_naming_the_tensor(torchstore):
    publisher, reader, _, manifest = await _delta_version("delta-corrupt")
    flip_byte(SHM_DIR / manifest.segment, HEADER + manifest.entries["head"].offset + 1)  # a new value's bits
    with pytest.raises(WeightChecksumError, match=r"policy version 1: tensor 'head' does not match the checksum"):
        await reader.fetch(1)
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_a_delta_that_rebuilds_other_bits_fails_the_check_of_the_rebuilt_tensor(torchstore):
    """A delta whose stored bytes pass their own check (here: re-checksummed after the corruption, as a publisher bug
    would) but rebuild another tensor is caught by the checksums of the tensor published."""
    publisher, reader, _, manifest = await _delta_version("delta-rebuilt")
    head = manifest.entries["head"]
    path = SHM_DIR / manifest.segment
    flip_byte(path, HEADER + head.offset + 1)
    with open(path, "rb") as segment:
        segment.seek(HEADER + head.offset)
        stored = torch.frombuffer(bytearray(segment.read(head.nbytes)), dtype=torch.uint8)
    entries = dict(manifest.entries)
    entries["head"] = dataclasses.replace(head, checksums=checksums(stored, manifest.checksum))
    await ts.put(publisher._manifest_key(1), dataclasses.replace(manifest, entries=entries))
    with pytest.raises(WeightChecksumError, match=r"policy version 1: tensor 'head' does not match the checksum.*"
                                                  r"corrupted tensors: \['head'\]"):
        await reader.fetch(1)
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_a_reader_whose_own_copy_was_corrupted_rebuilds_from_the_full_version(torchstore):
    publisher, reader, want, _ = await _delta_version("delta-held")
    held = reader._held["embed"].view(torch.int16).reshape(-1)
    unchanged = int((held == _bits(want["embed"]).reshape(-1)).nonzero()[0])  # the delta to version 1 leaves it
    held[unchanged] ^= 1  # its copy of version 0 is no longer what was published
    _assert_bit_identical(await reader.fetch(1), want, "rebuilt from version 0")
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_when_nearly_everything_changes_every_tensor_is_stored_whole(torchstore, monkeypatch):
    compared = []
    real_compare = weight_delta.compare
    monkeypatch.setattr(weight_delta, "compare", lambda old, new: compared.append(1) or real_compare(old, new))
    publisher, reader = WeightStore("delta-full", delta=DeltaSync(enabled=True)), WeightStore("delta-full")
    master = _first()
    for version in range(3):
        _step(master, version, everything=NAMES)  # every value moves (a tiny model at a high learning rate)
        manifest = await publisher.publish(master, version, dtype=torch.bfloat16)
        assert (manifest.base, manifest.anchor) == (None, version)
        assert {e.encoding for e in manifest.entries.values()} == {"full"}
        assert manifest.nbytes == manifest.tensor_nbytes
        _assert_bit_identical(await reader.fetch(version), _published(master), f"v{version}")
    assert len(compared) == 2 * len(NAMES)  # versions 1 and 2 compared each tensor, and fell back to it whole
    for version in await publisher.versions():
        await publisher.delete(version)


async def test_the_torchstore_path_carries_deltas(torchstore):
    publisher = WeightStore("delta-ts", transport="torchstore", delta=DeltaSync(enabled=True, full_every=3))
    reader = WeightStore("delta-ts", transport="torchstore")
    master = _first()
    for version in range(5):
        _step(master, version)
        manifest = await publisher.publish(master, version, dtype=torch.bfloat16)
        assert manifest.in_torchstore and manifest.segment is None
        assert (manifest.base is None) == (version % 3 == 0)
        _assert_bit_identical(await reader.fetch(version), _published(master), f"v{version}")
    stored = await ts.get(f"{publisher.tensors_key(4)}/head")
    assert stored.dtype == torch.uint8 and stored.numel() < master["head"].numel() * 2  # the delta's bytes only
    for version in await publisher.versions():
        await publisher.delete(version)


def test_bad_delta_settings_are_refused():
    with pytest.raises(ValueError, match=r"^full_every=0: must be an int >= 1"):
        DeltaSync(enabled=True, full_every=0)
    with pytest.raises(ValueError, match=r"^enabled='yes': must be true or false"):
        DeltaSync(enabled="yes")


async def test_each_version_records_its_bytes_its_changed_share_and_whether_it_is_a_delta(torchstore):
    from forge.metrics import drain_local

    publisher = WeightStore("delta-metrics", delta=DeltaSync(enabled=True))
    master = _first()
    drain_local()  # what the other tests recorded
    full = await publisher.publish(master, 0, dtype=torch.bfloat16)
    first = drain_local()
    _step(master, 1)
    delta = await publisher.publish(master, 1, dtype=torch.bfloat16)
    second = drain_local()
    assert first["weights/published_bytes"].total == full.nbytes == full.tensor_nbytes
    assert first["weights/published_delta"].total == 0.0 and "weights/changed_share" not in first  # nothing compared
    assert second["weights/published_bytes"].total == delta.nbytes < full.nbytes / 2
    assert second["weights/published_delta"].total == 1.0
    changed = sum(e.changed for e in delta.entries.values()) / sum(t.numel() for t in master.values())
    assert second["weights/changed_share"].total == pytest.approx(changed) and 0 < changed < 0.5
    for version in await publisher.versions():
        await publisher.delete(version)
