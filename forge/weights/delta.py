"""Deltas between two published versions of one tensor: only the elements whose bits changed.

At RL learning rates most elements of a bf16 publish keep their bits from one version to the next (the fp32
master moves by about the learning rate; the bf16 value changes only when it crosses a rounding boundary), so a
reader that holds the previous version needs only the changed positions and their new bits. Two encodings, the
smaller one is used (`bench/delta_share.py` measures both):

- sparse: int32 positions + the new values: 4 + itemsize bytes per changed element, smallest when few change;
- bitmask: one bit per element + the new values: numel / 8 + itemsize bytes per changed element.

Everything compares and copies bit patterns (integer views), so applying a delta gives the published tensor bit for
bit, NaN payloads and signed zeros included. No Monarch, no I/O: the weight store carries a delta as one byte
payload (`to_bytes` / `from_bytes`: the values, then the positions, 8-byte aligned).

Before comparing every element, `encode` compares a strided sample (one element in _SAMPLE_STRIDE): where nearly
every element changed (a tiny model at lr 3e-4: 94-99%) it refuses the delta after ~1% of the work, so a publisher
whose deltas do not pay falls back to full tensors at almost no cost.

A tensor of more than one step is compared, rebuilt and scattered in parts of whole steps on a pool of threads, one
per core this process may run on (numpy releases the GIL in these array operations); each part writes only its own
elements and bytes of the mask, and the parts' results are joined in order, so the bytes are the same as on one
thread. A tensor of one step or less stays on the calling thread (docs/benchmarks.md: a tensor of 1.5 steps already
took 5.6 ms on 2 threads against 8.1 ms on one).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy
import torch
from torch.distributed.tensor import DTensor

Encoding = Literal["sparse", "bitmask"]
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_SPARSE_NUMEL = 2**31 - 1  # int32 positions
_SAMPLE_STRIDE = 97  # the precheck's sample: one element in this many (a prime: no alignment with row lengths)
_SAMPLE_MIN_NUMEL = 1 << 16  # smaller tensors are compared whole at once
_SAMPLE_REFUSE = 0.95  # refuse without the full comparison when the sample's estimate exceeds this share of the tensor
_STEP = 1 << 20  # elements compared or rebuilt at a time (a multiple of 8: whole bytes of the packed mask)
_PARTS_PER_THREAD = 4  # a tensor's parts per pool thread: a thread slowed by other work takes fewer of them

_T = TypeVar("_T")
_pool: tuple[int, ThreadPoolExecutor] | None = None  # the process that made it, and the pool
_pool_lock = threading.Lock()


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
    return tensor.detach().contiguous().view(_BITS[tensor.element_size()]).reshape(-1)


def encode(previous: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """The delta from `previous` to `new` (same shape and dtype, on CPU), or None when it would not be smaller than
    `new` itself: then the full tensor is published."""
    return compare(previous, new)[0]


def compare(previous: torch.Tensor, new: torch.Tensor) -> tuple[TensorDelta | None, int]:
    """`encode`'s delta, and how many elements changed (estimated from the sample when it refused on it)."""
    if previous.shape != new.shape or previous.dtype != new.dtype:
        raise ValueError(f"a delta needs the same shape and dtype: {tuple(previous.shape)} {previous.dtype} -> "
                         f"{tuple(new.shape)} {new.dtype}")
    old_bits, new_bits = _bits(previous).numpy(), _bits(new).numpy()
    itemsize, numel = new.element_size(), new.numel()
    if numel >= _SAMPLE_MIN_NUMEL:
        sample = old_bits[::_SAMPLE_STRIDE] != new_bits[::_SAMPLE_STRIDE]
        estimate = numpy.count_nonzero(sample) * numel // sample.size
        if _smallest(estimate, numel, itemsize) > _SAMPLE_REFUSE * numel * itemsize:
            return None, estimate
    packed, values = _changes(old_bits, new_bits)
    count = values.size
    sparse = count * (4 + itemsize) if numel <= MAX_SPARSE_NUMEL else None
    bitmask = packed.size + count * itemsize
    if min(bitmask, sparse or bitmask) >= numel * itemsize:
        return None, count
    if sparse is not None and sparse <= bitmask:
        return TensorDelta("sparse", _tensor(_positions(packed, numel)), _tensor(values)), count
    return TensorDelta("bitmask", _tensor(packed), _tensor(values)), count


def _tensor(array: numpy.ndarray) -> torch.Tensor:
    """A 1-D array as a tensor of stride 1, sharing its memory (numpy may give an empty array stride 0, which torch
    then cannot view as bytes)."""
    return torch.from_numpy(array) if array.size else torch.empty(0, dtype=torch.from_numpy(array).dtype)


def _changes(old_bits: numpy.ndarray, new_bits: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The packed mask (numpy.packbits order) of the elements whose bits differ, and their new bits: one pass, _STEP
    elements at a time, each step's mask reused while it is in the core's cache; parts of whole steps in parallel."""
    packed = numpy.empty((new_bits.size + 7) // 8, dtype=numpy.uint8)

    def part(start: int, end: int) -> list[numpy.ndarray]:
        mask = numpy.empty(min(_STEP, end - start), dtype=numpy.bool_)  # each part its own
        values = []
        for first in range(start, end, _STEP):
            last = min(first + _STEP, end)
            step = mask[: last - first]
            numpy.not_equal(old_bits[first:last], new_bits[first:last], out=step)
            packed[first // 8 : (last + 7) // 8] = numpy.packbits(step)
            values.append(new_bits[first:last][step])
        return values

    parts = _in_parallel(part, _parts(new_bits.size))
    return packed, numpy.concatenate([new_bits[:0], *(values for in_part in parts for values in in_part)])


def _positions(packed: numpy.ndarray, numel: int) -> numpy.ndarray:
    """The int32 flat positions a packed mask of `numel` elements marks, in order (numel <= MAX_SPARSE_NUMEL)."""

    def part(start: int, end: int) -> list[numpy.ndarray]:
        positions = []
        for first in range(start, end, _STEP):
            last = min(first + _STEP, end)
            step = numpy.unpackbits(packed[first // 8 : (last + 7) // 8], count=last - first).view(numpy.bool_)
            positions.append(numpy.flatnonzero(step).astype(numpy.int32) + numpy.int32(first))
        return positions

    parts = _in_parallel(part, _parts(numel))
    return numpy.concatenate([numpy.empty(0, dtype=numpy.int32), *(p for in_part in parts for p in in_part)])


def _smallest(count: int, numel: int, itemsize: int) -> int:
    """Bytes of the smaller encoding of `count` changed elements out of `numel`."""
    bitmask = (numel + 7) // 8 + count * itemsize
    return min(bitmask, count * (4 + itemsize)) if numel <= MAX_SPARSE_NUMEL else bitmask


def to_bytes(delta: TensorDelta) -> torch.Tensor:
    """The delta as one uint8 tensor: its values, zero padding to 8 bytes, then its positions (so that each part
    can be viewed as its own type in place, `from_bytes`)."""
    values = delta.values.reshape(-1).view(torch.uint8)
    pad = -values.numel() % 8
    return torch.cat([values, torch.zeros(pad, dtype=torch.uint8), delta.positions.reshape(-1).view(torch.uint8)])


def from_bytes(encoding: str, payload: torch.Tensor, count: int, dtype: torch.dtype) -> TensorDelta:
    """The delta `to_bytes` gave `payload` (uint8, contiguous), for a tensor of `dtype` with `count` changed elements:
    views into the payload, no copy."""
    if encoding not in ("sparse", "bitmask"):
        raise ValueError(f"encoding={encoding!r}: must be 'sparse' or 'bitmask'")
    itemsize = dtype.itemsize
    values_end = count * itemsize
    positions_start = values_end + (-values_end % 8)
    if payload.numel() < positions_start:
        raise ValueError(f"a {encoding} delta of {count} values needs at least {positions_start} bytes; got "
                         f"{payload.numel()}")
    values = payload[:values_end].view(_BITS[itemsize])
    positions = payload[positions_start:]
    if encoding == "sparse":
        if positions.numel() != 4 * count:
            raise ValueError(f"a sparse delta of {count} values needs {4 * count} bytes of positions; got "
                             f"{positions.numel()}")
        positions = positions.view(torch.int32)
    return TensorDelta(encoding, positions, values)


def apply(target: torch.Tensor, delta: TensorDelta) -> None:
    """Rewrite `target` (holding the delta's base version, contiguous, on CPU) into the delta's new version. A delta
    that does not fit the tensor raises ValueError before anything is written."""
    if not target.is_contiguous():
        raise ValueError("a delta applies in place to a contiguous tensor")
    bits = target.detach().view(_BITS[target.element_size()]).view(-1)
    if delta.values.dtype != bits.dtype:
        raise ValueError(f"a delta of {delta.values.dtype} bit patterns cannot apply to a {target.dtype} tensor")
    bits, values, positions = bits.numpy(), delta.values.reshape(-1).numpy(), delta.positions.reshape(-1).numpy()
    if delta.encoding == "sparse":
        _apply_sparse(bits, values, positions)
    else:
        _apply_bitmask(bits, values, positions)


def _apply_sparse(bits: numpy.ndarray, values: numpy.ndarray, positions: numpy.ndarray) -> None:
    if positions.size != values.size:
        raise ValueError(f"a sparse delta needs one position per value; got {positions.size} positions for "
                         f"{values.size} values")
    if not positions.size:
        return
    parts = _parts(positions.size)  # a valid delta's positions are distinct: the parts write disjoint elements
    bounds = _in_parallel(lambda start, end: (int(positions[start:end].min()), int(positions[start:end].max())), parts)
    low, high = min(low for low, _ in bounds), max(high for _, high in bounds)
    if low < 0 or high >= bits.size:
        raise ValueError(f"a sparse delta's positions must lie in [0, {bits.size}); got {low}..{high}")

    def part(start: int, end: int) -> None:
        bits[positions[start:end]] = values[start:end]

    _in_parallel(part, parts)


def _apply_bitmask(bits: numpy.ndarray, values: numpy.ndarray, packed: numpy.ndarray) -> None:
    if packed.size != (bits.size + 7) // 8:
        raise ValueError(f"a bitmask delta of a {bits.size}-element tensor needs {(bits.size + 7) // 8} bytes of "
                         f"mask; got {packed.size}")
    parts = _parts(bits.size)
    counts = _in_parallel(lambda start, end: _marked(packed, start, end), parts)
    if sum(counts) != values.size:
        raise ValueError(f"a bitmask delta marks {sum(counts)} changed elements but carries {values.size} values")
    firsts = dict(zip((start for start, _ in parts), numpy.cumsum([0, *counts[:-1]]).tolist()))

    def part(start: int, end: int) -> None:
        at = firsts[start]  # the part's first value: the marks before it
        for first in range(start, end, _STEP):  # a step's mask unpacked while it is in the core's cache
            last = min(first + _STEP, end)
            step = numpy.unpackbits(packed[first // 8 : (last + 7) // 8], count=last - first).view(numpy.bool_)
            count = numpy.count_nonzero(step)
            bits[first:last][step] = values[at : at + count]
            at += count

    _in_parallel(part, parts)


def _marked(packed: numpy.ndarray, start: int, end: int) -> int:
    """How many of a packed mask's bits for elements start..end are set (start a multiple of 8; the bits of the last
    byte past `end`, padding at the tensor's end, do not count)."""
    whole = end // 8
    count = int(numpy.bitwise_count(packed[start // 8 : whole]).sum(dtype=numpy.int64))
    if end % 8:  # packbits order: element 8k is the byte's highest bit
        count += (int(packed[whole]) >> (8 - end % 8)).bit_count()
    return count


def _workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _parts(numel: int) -> list[tuple[int, int]]:
    """[0, numel) in contiguous parts of whole steps (so that each part's mask is whole bytes): up to
    _PARTS_PER_THREAD per core, one part (the calling thread) for a tensor of one step or on one core."""
    steps, workers = -(-numel // _STEP), _workers()
    count = max(1, min(steps, workers * _PARTS_PER_THREAD)) if workers > 1 else 1
    bounds = [steps * i // count * _STEP for i in range(count)] + [numel]
    return list(zip(bounds, bounds[1:]))


def _in_parallel(work: Callable[[int, int], _T], parts: Sequence[tuple[int, int]]) -> list[_T]:
    """`work(start, end)` of each part, in the parts' order: on the calling thread when there is one part, else on
    the pool (every part done, or failed, before it returns: none still writes after an error)."""
    if len(parts) == 1:
        return [work(*parts[0])]
    futures = [_executor().submit(work, start, end) for start, end in parts]
    wait(futures)
    return [future.result() for future in futures]


def _executor() -> ThreadPoolExecutor:
    """The process's pool, one thread per core; made anew in a forked child (the parent's threads are not there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="weight-delta"))
        return _pool[1]


class Chain:
    """A publisher's side of delta sync: the tensors it published last (its own copies, on the host) and where its
    chain of deltas stands. Each version compares every tensor with the previous one (`compare`): a delta where it
    is smaller, the full tensor else; a version of full tensors only (forced every `full_every` versions, on request,
    or because no delta paid) starts a new chain. `begin`, then `encode`+`keep` per tensor, then `end`; `reset`
    after a failed publish (the next version is full)."""

    def __init__(self, full_every: int) -> None:
        if not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every={full_every!r}: must be an int >= 1 (1: every version full)")
        self.full_every = full_every
        self.previous: dict[str, torch.Tensor] = {}
        self.version: int | None = None  # the version `previous` holds
        self.anchor: int | None = None  # the full version its chain starts from
        self.deltas = 0  # versions published with deltas since the anchor
        self._use_deltas = False
        self._any_delta = False

    def begin(self, force_full: bool) -> None:
        self._use_deltas = not force_full and self.version is not None and self.deltas + 1 < self.full_every
        self._any_delta = False

    def encode(self, name: str, new: torch.Tensor) -> tuple[TensorDelta | None, int]:
        """`new`'s delta from the previous version's `name` when this version may carry deltas and it is smaller,
        and the changed elements (-1: not compared)."""
        previous = self.previous.get(name) if self._use_deltas else None
        if previous is None or previous.shape != new.shape or previous.dtype != new.dtype:
            return None, -1
        delta, changed = compare(previous, new)
        self._any_delta = self._any_delta or delta is not None
        return delta, changed

    def keep(self, name: str, new: torch.Tensor, source: torch.Tensor) -> None:
        """Remember `new` as `name`'s published value (copied when it shares memory with the live `source`)."""
        local = source.to_local() if isinstance(source, DTensor) else source
        shared = new.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        self.previous[name] = new.clone() if shared else new

    def end(self, version: int) -> tuple[int | None, int]:
        """The version's base (None: all full) and anchor; the chain moves on to it."""
        base = self.version if self._any_delta else None
        self.anchor = version if base is None else self.anchor
        self.deltas = 0 if base is None else self.deltas + 1
        self.version = version
        return base, self.anchor

    def reset(self) -> None:
        self.previous, self.version, self.anchor, self.deltas = {}, None, None, 0
