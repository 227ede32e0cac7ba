"""Deltas between published versions: bit-exact, the smaller encoding, refused when not smaller."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.weight_delta import TensorDelta, apply, encode


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
