"""torch.distributed set-up inside a provisioned mesh (the provisioner has set RANK, WORLD_SIZE, MASTER_*)."""

from __future__ import annotations

import os

import torch.distributed as dist


def init_from_environment(device: str) -> tuple[int, int]:
    """Join this mesh's process group (gloo on CPU, nccl on GPU) when it has several processes."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)
    return rank, world_size
