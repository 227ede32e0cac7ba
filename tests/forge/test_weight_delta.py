"""Deltas between published versions: bit-exact, the smaller encoding, refused when not smaller."""

import multiprocessing
import os

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.weights import delta as weight_delta
from forge.weights.delta import Chain, TensorDelta, apply, compare, encode, from_bytes, to_bytes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _changed(base: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    where = torch.rand(base.shape, generator=g) < share
    new[where] = (base[where].float() + torch.randn(int(where.sum()), generator=g)).to(base.dtype)
    return new


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 5000), share=st.sampled_from([0.0, 0.001, 0.05, 0.3, 1.0]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_a_delta_applied_to_its_base_gives_the_new_tensor_bit_for_bit(numel, share, dtype, seed):
    base = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    new = _changed(base, share, seed + 1)
    delta = encode(base, new)
    if delta is None:  # not smaller than the tensor: published whole
        assert (numel + 7) // 8 + int((_bits(base) != _bits(new)).sum()) * new.element_size() >= new.nbytes
        return
    assert delta.nbytes < new.nbytes
    target = base.clone()
    apply(target, delta)
    assert torch.equal(_bits(target), _bits(new))


def test_nan_payloads_and_signed_zeros_survive():
    base = torch.zeros(1000, dtype=torch.bfloat16)
    new = base.clone()
    new[3] = -0.0
    _bits(new)[7] = 0x7FC1  # a NaN with a payload
    delta = encode(base, new)
    assert delta is not None and delta.values.numel() == 2  # -0.0 differs from +0.0 in its bits
    apply(base, delta)
    assert torch.equal(_bits(base), _bits(new))


def test_few_changes_are_sparse_many_are_a_bitmask_all_are_refused():
    base = torch.randn(10_000).to(torch.bfloat16)
    assert encode(base, _changed(base, 0.01, 1)).encoding == "sparse"  # 6 B x 1% < 1/8 B + 2 B x 1%
    assert encode(base, _changed(base, 0.3, 1)).encoding == "bitmask"
    assert encode(base, base.neg()) is None  # every element changed: the full tensor is smaller
    unchanged = encode(base, base.clone())
    assert (unchanged.encoding, unchanged.nbytes) == ("sparse", 0)


def test_a_chain_of_deltas_reaches_the_last_version():
    versions = [torch.randn(4096).to(torch.bfloat16)]
    for seed in range(5):
        versions.append(_changed(versions[-1], 0.02, seed))
    reader = versions[0].clone()
    for previous, new in zip(versions, versions[1:]):
        apply(reader, encode(previous, new))
    assert torch.equal(_bits(reader), _bits(versions[-1]))


def test_a_corrupt_bitmask_delta_is_refused():
    base = torch.randn(1000).to(torch.bfloat16)
    delta = encode(base, _changed(base, 0.3, 2))
    assert delta.encoding == "bitmask"
    with pytest.raises(ValueError, match="marks .* changed elements but carries"):
        apply(base.clone(), TensorDelta("bitmask", delta.positions, delta.values[:-1]))


def test_mismatched_tensors_are_refused():
    with pytest.raises(ValueError, match="same shape and dtype"):
        encode(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="bit patterns cannot apply"):
        apply(torch.zeros(100), encode(torch.zeros(100, dtype=torch.bfloat16), _changed(torch.zeros(100, dtype=torch.bfloat16), 0.05, 3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.3])  # 0.0: nothing changed, an empty delta
def test_a_delta_travels_as_one_byte_payload(dtype, share):
    base = torch.randn(3001).to(dtype)
    new = _changed(base, share, 4)
    delta = encode(base, new)
    payload = to_bytes(delta)
    assert payload.dtype == torch.uint8 and payload.numel() <= delta.nbytes + 7
    target = base.clone()
    apply(target, from_bytes(delta.encoding, payload, delta.values.numel(), dtype))
    assert torch.equal(_bits(target), _bits(new))


def test_a_payload_of_the_wrong_size_or_positions_out_of_range_is_refused():
    base = torch.randn(1000).to(torch.bfloat16)
    delta = encode(base, _changed(base, 0.01, 5))
    payload = to_bytes(delta)
    with pytest.raises(ValueError, match="sparse delta of .* values needs .* bytes of positions"):
        from_bytes("sparse", payload[:-4], delta.values.numel(), torch.bfloat16)
    wild = TensorDelta("sparse", delta.positions.clone(), delta.values)
    wild.positions[0] = 5000
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 1000\)"):
        apply(base.clone(), wild)


def test_a_tensor_that_nearly_all_changed_is_refused_on_a_sample(monkeypatch):
    """The precheck compares one element in _SAMPLE_STRIDE: nearly everything changed, no full comparison."""
    base = torch.randn(1 << 17).to(torch.bfloat16)
    full_comparisons = []
    real_changes = weight_delta._changes

    def changes(old, new):
        full_comparisons.append(new.size)
        return real_changes(old, new)

    monkeypatch.setattr(weight_delta, "_changes", changes)
    delta, changed = compare(base, base.neg())
    assert delta is None and changed == base.numel()  # estimated from the sample: every sampled element changed
    assert full_comparisons == []
    delta, changed = compare(base, _changed(base, 0.02, 6))
    assert delta is not None and changed == delta.values.numel() and full_comparisons == [base.numel()]


@pytest.mark.parametrize("numel", [64, 67, 1000, 1003])
@pytest.mark.parametrize("share", [0.01, 0.3])
def test_deltas_are_bit_exact_across_the_steps_they_are_made_and_applied_in(monkeypatch, numel, share):
    """compare and apply walk a tensor _STEP elements at a time: a step of 16 elements here, so that changes fall
    on every step's edges, and a tensor whose end is mid-step and mid-byte of the mask."""
    monkeypatch.setattr(weight_delta, "_STEP", 16)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(torch.bfloat16)
    new = _changed(base, share, numel + 1)
    _bits(new)[[0, 15, 16, numel - 1]] += 1  # a step's first and last elements, and the tensor's last
    delta = encode(base, new)
    expected = _bits(base) != _bits(new)
    assert torch.equal(delta.values, _bits(new)[expected])
    if delta.encoding == "sparse":
        assert torch.equal(delta.positions, expected.nonzero().reshape(-1).to(torch.int32))
    target = base.clone()
    apply(target, delta)
    assert torch.equal(_bits(target), _bits(new))


def test_a_bitmask_of_the_wrong_length_or_count_is_refused_and_its_padding_bits_are_not_changes():
    base = torch.randn(1003).to(torch.bfloat16)
    new = _changed(base, 0.3, 7)
    delta = encode(base, new)
    assert delta.encoding == "bitmask"
    with pytest.raises(ValueError, match="1003-element tensor needs 126 bytes of mask; got 125"):
        apply(base.clone(), TensorDelta("bitmask", delta.positions[:-1], delta.values))
    with pytest.raises(ValueError, match="marks .* changed elements but carries"):
        apply(base.clone(), TensorDelta("bitmask", delta.positions, delta.values[:-1]))
    padded = delta.positions.clone()
    padded[-1] |= 0b1  # the mask's bit 1007: past the tensor's 1003 elements, not a change
    target = base.clone()
    apply(target, TensorDelta("bitmask", padded, delta.values))
    assert torch.equal(_bits(target), _bits(new))


def test_a_chain_is_full_every_n_versions_and_after_a_reset():
    chain, tensor = Chain(full_every=3), torch.randn(4096).to(torch.bfloat16)
    bases = []
    for version in range(7):
        chain.begin(force_full=version == 5)
        tensor = _changed(tensor, 0.01, version)
        delta, _ = chain.encode("w", tensor)
        chain.keep("w", tensor, tensor)
        assert chain.previous["w"] is not tensor and torch.equal(chain.previous["w"], tensor)  # its own copy
        bases.append(chain.end(version))
    # 0 full; 1, 2 deltas; 3 full (every 3); 4 delta; 5 full (asked for); 6 delta
    assert bases == [(None, 0), (0, 0), (1, 0), (None, 3), (3, 3), (None, 5), (5, 5)]
    chain.reset()
    chain.begin(force_full=False)
    assert chain.encode("w", tensor) == (None, -1)  # nothing to compare with after a failed publish
    with pytest.raises(ValueError, match="full_every=0: must be an int >= 1"):
        Chain(full_every=0)


_SPLIT_NUMEL = 4 * weight_delta._STEP - 5  # 4 steps, the last one short and ending mid-byte of the mask


def _across_steps(share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of several steps and its next version: `share` of it changed, and every element at a step's edge."""
    base = torch.randn(_SPLIT_NUMEL, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    new = _changed(base, share, 9)
    edges = [0, _SPLIT_NUMEL - 1] + [k * weight_delta._STEP + d for k in (1, 2, 3) for d in (-1, 0, 1)]
    _bits(new)[edges] = _bits(base)[edges] + 1
    return base, new


@pytest.mark.parametrize("workers,parts_per_thread,parts", [(2, 1, 2), (3, 1, 3), (2, 4, 4)])
@pytest.mark.parametrize("share", [0.01, 0.3])  # sparse, bitmask
def test_the_threaded_encode_and_apply_give_the_bytes_of_one_thread(monkeypatch, workers, parts_per_thread, parts,
                                                                     share):
    """Parts of whole steps on the pool (3 parts of 4 steps: uneven ones) give the same delta, byte for byte, as the
    whole tensor on the calling thread, and it applies to the same bits on either."""
    base, new = _across_steps(share)
    monkeypatch.setattr(weight_delta, "_workers", lambda: 1)
    one = encode(base, new)
    one_applied = base.clone()
    apply(one_applied, one)
    monkeypatch.setattr(weight_delta, "_workers", lambda: workers)
    monkeypatch.setattr(weight_delta, "_PARTS_PER_THREAD", parts_per_thread)
    assert len(weight_delta._parts(_SPLIT_NUMEL)) == parts
    threaded = encode(base, new)
    assert threaded.encoding == one.encoding == ("sparse" if share < 0.03 else "bitmask")
    assert torch.equal(threaded.positions, one.positions) and torch.equal(threaded.values, one.values)
    assert torch.equal(to_bytes(threaded), to_bytes(one))
    expected = _bits(base) != _bits(new)  # and both are the changes, not the same mistake twice
    assert torch.equal(threaded.values, _bits(new)[expected])
    threaded_applied = base.clone()
    apply(threaded_applied, threaded)
    assert torch.equal(_bits(threaded_applied), _bits(one_applied))
    assert torch.equal(_bits(threaded_applied), _bits(new))


def test_a_threaded_apply_refuses_a_delta_that_does_not_fit_before_writing(monkeypatch):
    monkeypatch.setattr(weight_delta, "_workers", lambda: 2)
    base, new = _across_steps(0.3)
    delta = encode(base, new)
    target = base.clone()
    with pytest.raises(ValueError, match="marks .* changed elements but carries"):
        apply(target, TensorDelta("bitmask", delta.positions, delta.values[:-1]))
    base, new = _across_steps(0.01)
    delta = encode(base, new)
    wild = TensorDelta("sparse", delta.positions.clone(), delta.values)
    wild.positions[-1] = _SPLIT_NUMEL  # one past the end, in the last part
    with pytest.raises(ValueError, match=rf"positions must lie in \[0, {_SPLIT_NUMEL}\)"):
        apply(target, wild)
    with pytest.raises(ValueError, match="one position per value"):
        apply(target, TensorDelta("sparse", delta.positions, delta.values[:-1]))
    assert torch.equal(_bits(target), _bits(base))  # nothing written


def test_a_tensor_of_one_step_stays_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(weight_delta, "_workers", lambda: 16)
    step = weight_delta._STEP
    assert weight_delta._parts(step) == [(0, step)]
    assert weight_delta._parts(step + 1) == [(0, step), (step, step + 1)]
    monkeypatch.setattr(weight_delta, "_workers", lambda: 1)
    assert weight_delta._parts(_SPLIT_NUMEL) == [(0, _SPLIT_NUMEL)]  # one core: no pool


def _encode_in_child(base: torch.Tensor, new: torch.Tensor, values: numpy.ndarray, positions: numpy.ndarray) -> None:
    delta = encode(base, new)  # compared with numpy: torch's own OpenMP threads are not usable in a forked child either
    same = numpy.array_equal(delta.values.numpy(), values) and numpy.array_equal(delta.positions.numpy(), positions)
    os._exit(0 if same else 1)


def test_a_forked_child_gets_its_own_pool(monkeypatch):
    """The parent's pool threads are not in a forked child: a child using the parent's pool would wait forever."""
    monkeypatch.setattr(weight_delta, "_workers", lambda: 2)
    base, new = _across_steps(0.3)
    delta = encode(base, new)  # the parent's pool now exists
    child = multiprocessing.get_context("fork").Process(
        target=_encode_in_child, args=(base, new, delta.values.numpy(), delta.positions.numpy()))
    child.start()
    child.join(60)
    if child.exitcode is None:  # waiting on threads it does not have
        child.kill()
    assert child.exitcode == 0
