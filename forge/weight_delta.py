"""Deltas between two published versions of one tensor: only the elements whose bits changed.

At RL learning rates most elements of a bf16 publish keep their bits from one version to the next (the fp32
master moves by about the learning rate; the bf16 value changes only when it crosses a rounding boundary), so a
reader that holds the previous version needs only the changed positions and their new bits. Two encodings, the
smaller one is used (`bench/delta_share.py` measures both):

- sparse: int32 positions + the new values: 4 + itemsize bytes per changed element, smallest when few change;
- bitmask: one bit per element + the new values: numel / 8 + itemsize bytes per changed element.

Everything compares and copies bit patterns (integer views), so applying a delta gives the published tensor bit for
bit, NaN payloads and signed zeros included. No Monarch, no I/O: the weight store carries the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy
import torch

Encoding = Literal["sparse", "bitmask"]
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_SPARSE_NUMEL = 2**31 - 1  # int32 positions


@dataclass(frozen=True)
class TensorDelta:
    encoding: Encoding
    positions: torch.Tensor  # sparse: int32 flat positions; bitmask: uint8 packed mask (numpy.packbits order)
    values: torch.Tensor  # the new bit patterns of the changed elements, as the tensor's integer type

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat, as a same-size integer tensor (a view where the tensor is contiguous)."""
    if tensor.element_size() not in _BITS:
        raise TypeError(f"a weight delta needs 1, 2, 4 or 8-byte elements; got {tensor.dtype}")
    return tensor.contiguous().view(_BITS[tensor.element_size()]).reshape(-1)


def encode(previous: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """The delta from `previous` to `new` (same shape and dtype, on CPU), or None when it would not be smaller than
    `new` itself: then the full tensor is published."""
    if previous.shape != new.shape or previous.dtype != new.dtype:
        raise ValueError(f"a delta needs the same shape and dtype: {tuple(previous.shape)} {previous.dtype} -> "
                         f"{tuple(new.shape)} {new.dtype}")
    old_bits, new_bits = _bits(previous), _bits(new)
    changed = old_bits != new_bits
    count = int(changed.sum())
    itemsize, numel = new.element_size(), new.numel()
    sparse = count * (4 + itemsize) if numel <= MAX_SPARSE_NUMEL else None
    bitmask = (numel + 7) // 8 + count * itemsize
    if min(bitmask, sparse or bitmask) >= numel * itemsize:
        return None
    values = new_bits[changed]
    if sparse is not None and sparse <= bitmask:
        return TensorDelta("sparse", changed.nonzero().reshape(-1).to(torch.int32), values)
    packed = torch.from_numpy(numpy.packbits(changed.numpy()))
    return TensorDelta("bitmask", packed, values)


def apply(target: torch.Tensor, delta: TensorDelta) -> None:
    """Rewrite `target` (holding the delta's base version, contiguous, on CPU) into the delta's new version."""
    if not target.is_contiguous():
        raise ValueError("a delta applies in place to a contiguous tensor")
    bits = target.view(_BITS[target.element_size()]).view(-1)
    if delta.values.dtype != bits.dtype:
        raise ValueError(f"a delta of {delta.values.dtype} bit patterns cannot apply to a {target.dtype} tensor")
    if delta.encoding == "sparse":
        bits[delta.positions.long()] = delta.values
        return
    mask = torch.from_numpy(numpy.unpackbits(delta.positions.numpy(), count=bits.numel()).view(numpy.bool_))
    if int(mask.sum()) != delta.values.numel():
        raise ValueError(f"a bitmask delta marks {int(mask.sum())} changed elements but carries "
                         f"{delta.values.numel()} values")
    bits[mask] = delta.values
