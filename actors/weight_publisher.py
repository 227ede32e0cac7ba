"""Publishing a trainer's weights as policy versions, off the training step's critical path.

    publisher.start(trainer.hf_state_dict_shards(), trainer.policy_version, trainer.optimizers)   # every rank
    ...                             # the next step's forward and backward passes run meanwhile
    version = await publisher.wait()   # the version is in the store and advertised (raises its error)

A publish reads the live parameters (no snapshot), casts each tensor to the generators' dtype on its own
rank, gathers it to rank 0 alone and streams it into the weight store (forge/weights/store.py). The only
thing that must wait for it is the next change of the parameters: the optimizer's step waits until the
publisher has read them all. One version is in flight at a time; versions older than `keep_versions`
are deleted once a new one is advertised.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from forge.distributed import group_rank, group_size
from forge.weights.store import WeightStore


class WeightPublisher:
    def __init__(self, store: WeightStore, *, dtype: torch.dtype, keep_versions: int) -> None:
        self.store, self.dtype, self.keep_versions = store, dtype, keep_versions
        # Its own process group: its gathers run beside the training step's collectives (every rank builds it).
        self.group = dist.new_group(backend="gloo") if group_size() > 1 else None
        self.last_publish_s = 0.0  # how long the last completed publish took
        self._task: asyncio.Future | None = None
        self._params_free = threading.Event()  # cleared while a publish reads the parameters
        self._params_free.set()
        self._loop_thread: threading.Thread | None = None
        self._hooked: Any = None

    def start(self, shards: dict[str, torch.Tensor], version: int, optimizer: torch.optim.Optimizer) -> None:
        """Begin publishing `shards` (the live parameters in HF names: `TitanTrainer.hf_state_dict_shards()`)
        as `version`, on every rank; returns at once. `optimizer` waits before its next step until they are
        read. The previous version must be complete: `await wait()` first."""
        if self._task is not None:
            raise RuntimeError("WeightPublisher.start: a version is still being published; await wait() first")
        if self._hooked is not optimizer:
            optimizer.register_step_pre_hook(lambda *_: self._wait_until_read())
            self._hooked = optimizer
        self._loop_thread = threading.current_thread()
        self._params_free.clear()
        self._task = asyncio.ensure_future(self._publish(shards, version))
        # Set even if the task is cancelled before it runs, or the optimizer would wait forever.
        self._task.add_done_callback(lambda _: self._params_free.set())

    async def wait(self) -> int | None:
        """Until the version in flight is advertised; returns it (None when nothing was in flight) and raises
        what its publishing raised."""
        task = self._task
        if task is None:
            return None
        try:
            return await asyncio.shield(task)  # a cancelled waiter leaves the publish running
        finally:
            if task.done():
                self._task = None

    async def _publish(self, shards: dict[str, torch.Tensor], version: int) -> int:
        started = time.perf_counter()
        await self.store.publish(shards, version, dtype=self.dtype, group=self.group)
        self._params_free.set()
        if group_rank(self.group) == 0:
            await self.store.delete_older_than(version - self.keep_versions + 1)
        self.last_publish_s = time.perf_counter() - started
        return version

    def _wait_until_read(self) -> None:
        if not self._params_free.is_set() and threading.current_thread() is self._loop_thread:
            # The publish runs on this thread's event loop: blocking here would stop it for good.
            raise RuntimeError("the optimizer would change the parameters while they are being published, on the "
                               "thread whose event loop publishes them; await WeightPublisher.wait() first")
        self._params_free.wait()
