"""Actors for forge's own tests and for users testing their apps (importable by spawned processes)."""

from __future__ import annotations

import asyncio
import os

from forge.actor import ForgeActor, endpoint
import torch

from forge.metrics import record_metric
from forge.weight_store import WeightStore


class EchoActor(ForgeActor):
    """Answers with its process id so tests can see which replica served a call."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.calls = 0
        self.setup_done = False

    @endpoint
    async def setup(self) -> None:
        self.setup_done = True

    @endpoint
    async def echo(self, value: object, delay: float = 0.0) -> tuple[str, int, object]:
        self.calls += 1
        if delay:
            await asyncio.sleep(delay)
        return self.tag, os.getpid(), value

    @endpoint
    async def info(self) -> dict:
        return {"pid": os.getpid(), "calls": self.calls, "setup_done": self.setup_done, "env": dict(os.environ)}

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def record(self, name: str, value: float, reduce: str = "mean") -> None:
        record_metric(name, value, reduce)


def constant_state_dict(version: int) -> dict[str, torch.Tensor]:
    """A small HF-named state dict whose values are derived from `version` (easy to check after a fetch)."""
    return {
        "model.embed_tokens.weight": torch.full((32, 16), float(version)),
        "model.layers.0.mlp.up_proj.weight": torch.arange(48, dtype=torch.bfloat16).reshape(3, 16) + version,
        "lm_head.weight": torch.full((32, 16), -float(version)),
    }


class WeightReader(ForgeActor):
    @endpoint
    async def read(self, namespace: str, version: int) -> dict:
        store = WeightStore(namespace)
        weights = await store.fetch(version)
        return {"latest": await store.latest_version(), "sums": {k: float(v.float().sum()) for k, v in weights.items()},
                "pid": os.getpid()}


class ShardedPublisher(ForgeActor):
    """Two ranks holding FSDP (DTensor) shards publish one version together."""

    @endpoint
    async def publish_sharded(self, namespace: str, version: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        full = constant_state_dict(version)
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if v.shape[0] % 2 == 0}
        await WeightStore(namespace).publish(sharded, version)
