"""Actors for forge's own tests and for users testing their apps (importable by spawned processes)."""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import torch

from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric
from forge.tasks import ArithmeticTask
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


# --- helpers for tests that run whole apps as subprocesses ------------------------------------------------
MARK_VARIABLE = "FORGE_TEST_MARK"


def marked_environment(mark: str) -> dict[str, str]:
    """The current environment plus a mark every process of the run inherits (Monarch's included)."""
    return {**os.environ, MARK_VARIABLE: mark}


def processes_with_mark(mark: str, timeout: float = 30.0) -> list[str]:
    """Processes still carrying `mark` after up to `timeout` seconds (empty when all have exited)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.environ().get(MARK_VARIABLE) == mark:
                    left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def faulty_reward(completion_text: str, answer: str) -> float:
    """The arithmetic task's exact-match reward, except that a fixed quarter of completions make it raise,
    a quarter hang for 2 s and a quarter return NaN (fault-injection tests: `task.reward=forge.testing:faulty_reward`)."""
    kind = zlib.crc32(completion_text.encode()) % 4
    if kind == 0:
        raise RuntimeError(f"injected reward failure for {completion_text!r}")
    if kind == 1:
        time.sleep(2.0)
    if kind == 2:
        return float("nan")
    return ArithmeticTask(seed=0, held_out=1).reward(completion_text, answer)
