"""torch.distributed inside a provisioned mesh (the provisioner has set RANK, WORLD_SIZE, MASTER_*): joining the
process group, splitting a batch over the data-parallel ranks, and gathering a sharded tensor to one rank."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def init_from_environment(device: str) -> tuple[int, int]:
    """Join this mesh's process group (gloo on CPU, nccl on GPU) when it has several processes."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        store = rendezvous_store(rank, world_size)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world_size)
    return rank, world_size


def rendezvous_store(rank: int, world_size: int) -> dist.TCPStore:
    """The process group's rendezvous store at MASTER_ADDR:MASTER_PORT, which rank 0 serves. torch's own (`env://`)
    listens on every interface, and it authenticates nobody: rank 0 hands it a socket bound to MASTER_ADDR alone (the
    address the provisioner chose: loopback on one host, the host's own address across hosts)."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=dist.default_pg_timeout)
    listener = socket.create_server((address, port))
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=dist.default_pg_timeout,
                         master_listen_fd=listener.detach())  # the store owns the socket from here on


def local_device(device_type: str) -> torch.device:
    """This rank's device, made the calling thread's current one: on CUDA the one LOCAL_RANK names (the
    launcher's convention). Call it on every thread that runs the model: the current device is per thread."""
    if device_type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device_type!r}: CUDA is not available on this host; use 'cpu'")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the default group when None); 0 without torch.distributed."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in the data-parallel dimension. Every rank holds the whole batch, works on its own
    contiguous rows, and gathers the results of all rows in rank order."""

    degree: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, parallel_dims: Any) -> DataParallel:
        """The data-parallel dimension of a torchtitan `ParallelDims` (none without one)."""
        if not parallel_dims.dp_enabled:
            return cls()
        mesh = parallel_dims.get_mesh("fsdp")  # forge shards over every data-parallel rank, replicates over none
        return cls(mesh.size(), mesh.get_local_rank(), mesh.get_group())

    def rows(self, num_rows: int) -> tuple[int, int]:
        """This rank's rows [start, stop) of a batch of `num_rows`."""
        if num_rows % self.degree:
            raise ValueError(f"batch of {num_rows} sequences: must be a multiple of the data-parallel degree "
                             f"{self.degree}")
        per_rank = num_rows // self.degree
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, concatenated in rank order."""
        if self.degree == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)


def gather_to_rank0(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """The full tensor of a DTensor, on CPU, on rank 0 of `group` only (None on the others); a plain tensor is
    already whole and comes back as is on rank 0. A collective over `group`, which must hold every rank of the
    DTensor's mesh: each rank sends its local piece (as bytes, so any dtype goes over gloo), and only rank 0
    ever holds the whole tensor."""
    is_root = group_rank(group) == 0
    if not isinstance(tensor, DTensor):
        return tensor.detach() if is_root else None
    local = tensor.to_local().detach().cpu().contiguous()
    if tensor.device_mesh.get_coordinate() is None:  # this rank is outside the tensor's mesh: it holds none of it
        shape, offset = (0,) * tensor.dim(), (0,) * tensor.dim()
    else:
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    # Where each rank's piece goes; every rank learns the largest piece so all send buffers are one size.
    layout = torch.tensor([*shape, *offset], dtype=torch.long)
    layouts = [torch.empty_like(layout) for _ in range(group_size(group))]
    dist.all_gather(layouts, layout, group=group)
    itemsize = tensor.dtype.itemsize
    capacity = max(int(torch.Size(t[: tensor.dim()].tolist()).numel()) for t in layouts) * itemsize
    send = torch.zeros(capacity, dtype=torch.uint8)
    send[: local.numel() * itemsize] = local.reshape(-1).view(torch.uint8)
    received = [torch.empty_like(send) for _ in layouts] if is_root else None
    dist.gather(send, received, group_dst=0, group=group)
    if not is_root:
        return None
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    for piece, layout in zip(received, layouts):
        piece_shape, piece_offset = layout[: tensor.dim()].tolist(), layout[tensor.dim() :].tolist()
        numel = int(torch.Size(piece_shape).numel())
        if numel:
            region = full[tuple(slice(o, o + n) for o, n in zip(piece_offset, piece_shape))]
            region.copy_(piece[: numel * itemsize].view(tensor.dtype).view(piece_shape))
    return full
