"""The publisher's side of a version: each tensor gathered to rank 0, then its pieces copied into the version's
segment and hashed on a pool of threads, one per core this process may run on (the copies and the hashes release
the GIL), while the next tensor is gathered. A piece is marked ready only once its bytes are in place and hashed, and
`ready` moves only over pieces with no gap before them: a reader or a relay never takes a piece before its hash
exists, whatever order the threads finish in. A tensor on a GPU is copied by DMA straight into the segment's mapping
(pinned with cudaHostRegister, `SegmentWriter.pin_for_device`): no staging copy in host memory.
Needs torch only (no Monarch, no torchstore)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from forge.distributed import gather_to_rank0
from forge.weights import checksums as _sums
from forge.weights.checksums import _Hasher, _bytes_of
from forge.weights.segment import SegmentWriter


def gathered(tensor: torch.Tensor, dtype: torch.dtype | None, group: dist.ProcessGroup | None = None
             ) -> torch.Tensor | None:
    """`tensor` cast to `dtype` on its own rank (shards before they travel) and gathered to rank 0, on the device it
    is on: a contiguous tensor on rank 0, None on the other ranks. A collective under FSDP/TP."""
    full = gather_to_rank0(tensor.detach().to(dtype or tensor.dtype), group)
    return None if full is None else full.contiguous()


def gathered_on_host(tensor: torch.Tensor, dtype: torch.dtype | None,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """`gathered`, copied into host memory: a contiguous CPU tensor on rank 0, None on the other ranks."""
    full = gathered(tensor, dtype, group)
    return None if full is None else full.cpu().contiguous()


class PieceWriter:
    """Copies tensors' pieces (_CHUNK bytes each) into `segment` at their offsets and hashes them, on up to `threads`
    threads (default: the cores this process may run on); with no segment (a version published to torchstore only)
    it only hashes them. `add` returns once the tensor's pieces are queued (it waits while more than `max_pending`
    bytes are queued: a queued piece keeps its tensor alive); `finish` waits for every piece and returns each
    tensor's checksums, or raises the first failure; `abort` waits for the pieces under way and drops the rest."""

    def __init__(self, segment: SegmentWriter | None, algorithm: str, threads: int | None = None,
                 max_pending: int | None = None) -> None:
        self.segment, self.algorithm = segment, algorithm
        self.threads = max(1, _sums._IO_THREADS if threads is None else threads)
        self.max_pending = max_pending if max_pending is not None else 2 * self.threads * _sums._CHUNK
        _Hasher(algorithm)  # an unknown algorithm fails here, before any write
        self._sums: dict[str, list[int | None]] = {}
        self._futures: list[Future] = []
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weight-publish") if self.threads > 1 else None
        self._pending, self._room = 0, threading.Condition()
        self._pinned = False

    def add(self, name: str, tensor: torch.Tensor, offset: int) -> None:
        """Queue `tensor`'s pieces (contiguous, of the dtype stored; on the CPU or a device) for tensor offset
        `offset` of the segment."""
        nbytes = tensor.numel() * tensor.element_size()
        starts = range(0, nbytes, _sums._CHUNK)
        sums = self._sums[name] = [None] * len(starts)
        if tensor.device.type == "cuda" and self.segment is not None and not self._pinned:
            self._pinned = self.segment.pin_for_device()
        for index, start in enumerate(starts):
            end = min(start + _sums._CHUNK, nbytes)
            if self._pool is None:
                sums[index] = self._piece(tensor, offset, start, end)
                continue
            with self._room:
                self._room.wait_for(lambda: self._pending < self.max_pending)
                self._pending += end - start
            self._futures.append(self._pool.submit(self._queued, sums, index, tensor, offset, start, end))

    def _queued(self, sums: list[int | None], index: int, tensor: torch.Tensor, offset: int, start: int,
                end: int) -> None:
        try:
            sums[index] = self._piece(tensor, offset, start, end)
        finally:
            with self._room:
                self._pending -= end - start
                self._room.notify_all()

    def _piece(self, tensor: torch.Tensor, offset: int, start: int, end: int) -> int:
        if self.segment is not None:
            return self.segment.write_piece(tensor, offset, start, end, self.algorithm)
        hasher = _Hasher(self.algorithm)
        hasher.update(_bytes_of(tensor.cpu())[start:end])
        return hasher.digest()

    def finish(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's checksums, once all its pieces are written; the first failure of a piece else."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self.abort()
        return {name: tuple(sums) for name, sums in self._sums.items()}  # type: ignore[arg-type]

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
