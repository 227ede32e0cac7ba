"""The trainer actor: a TitanTrainer on every rank of a proc mesh, publishing every policy version it trains.

The trainer's parts, one job each:
- actors/trainer_config.py   TrainerConfig, checked before any process starts
- actors/model_builder.py    the torchtitan model of a Hugging Face checkpoint (shared with the reference model)
- actors/logprobs.py         per-token log-probs and entropies (shared with the reference model)
- actors/titan_trainer.py    TitanTrainer: the training step, exact gradient accumulation, minibatches
- actors/checkpoint.py       checkpoints and Hugging Face exports on disk
- actors/weight_publisher.py publishing versions off the training step's critical path
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from actors.trainer_config import TrainerConfig
from actors.weight_publisher import WeightPublisher
from forge.actor import ForgeActor, endpoint
from forge.distributed import init_from_environment, local_device
from rl.types import TrainBatch
from forge.weights.store import WeightStore

if TYPE_CHECKING:
    from actors.titan_trainer import TitanTrainer

__all__ = ["TrainStepResult", "TrainerActor"]


@dataclass
class TrainStepResult:
    """What a training step returns: the policy version it made (being published) and the step's metrics."""

    version: int
    metrics: dict[str, float]


class TrainerActor(ForgeActor):
    """The trainer on a proc mesh of `procs` data-parallel ranks: every endpoint runs on every rank.

    After each training step the new weights (HF names, in `publish_dtype`) are published to the weight store
    as the next policy version, in the background: `train_step` returns once the optimizer has stepped, the
    next step's forward and backward passes overlap the publish, and generators see the version only once it
    is complete. Versions older than `keep_versions` are deleted.
    """

    def __init__(self, config: TrainerConfig | dict, weight_namespace: str = "policy", keep_versions: int = 3) -> None:
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig(**config)
        self.weight_namespace = weight_namespace
        self.keep_versions = keep_versions
        self._publisher: WeightPublisher | None = None
        self._executor: ThreadPoolExecutor | None = None

    @endpoint
    async def setup(self) -> None:
        if self.config.torch_threads and self.config.device == "cpu":
            # On a shared CPU host, more threads than cores left idle only adds contention.
            torch.set_num_threads(self.config.torch_threads)
        rank, world_size = init_from_environment(self.config.device)
        # Imported here, in the trainer's processes: torchtitan and peft would add seconds to every controller's start.
        from actors.titan_trainer import TitanTrainer

        self.trainer: TitanTrainer = await self._compute(TitanTrainer, self.config, rank=rank, world_size=world_size)
        self.store = WeightStore(self.weight_namespace)

    async def _compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the trainer's work on its own thread, so the event loop keeps publishing meanwhile."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainer", initializer=local_device,
                                                initargs=(self.config.device,))
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    @property
    def publisher(self) -> WeightPublisher:
        if self._publisher is None:  # built at the first publish (a subclass's setup may skip ours)
            self._publisher = WeightPublisher(self.store, dtype=getattr(torch, self.config.publish_dtype),
                                              keep_versions=self.keep_versions)
        return self._publisher

    async def _start_publish(self) -> None:
        await self.publisher.wait()  # the previous version first (raises if it failed)
        shards = await self._compute(self.trainer.hf_state_dict_shards)
        self.publisher.start(shards, self.trainer.policy_version, self.trainer.optimizers)

    async def _publish(self) -> int:
        """Publish the current weights as the current policy version; returns once generators can fetch it."""
        await self._start_publish()
        return await self.publisher.wait()

    @endpoint
    async def publish_weights(self) -> int:
        """Publish the current weights as the current policy version (e.g. version 0 before any rollout)."""
        return await self._publish()

    @endpoint
    async def train_step(self, batch: TrainBatch) -> TrainStepResult:
        """One training step on the whole batch (each rank trains its slice; `minibatches` optimizer steps),
        then start publishing the new weights as the next policy version, which it returns with the step's metrics.
        `publish_s` is how long the last completed publish took, `publish_wait_s` how long this step waited for it
        after its own work."""
        return await self._train(batch)

    async def _train(self, batch: TrainBatch) -> TrainStepResult:
        metrics = await self._compute(self.trainer.train_step, batch)
        waited = time.perf_counter()
        await self._start_publish()
        metrics.update(publish_s=self.publisher.last_publish_s, publish_wait_s=time.perf_counter() - waited)
        return TrainStepResult(self.trainer.policy_version, metrics)

    @endpoint
    async def train_from(self, buffer: Any, policy_version: int) -> TrainStepResult:
        """`train_step` on the batch the replay buffer actor `buffer` sampled for `policy_version`: each rank fetches it
        from the buffer itself, so the caller passes a handle and a version, not the batch's tensors."""
        return await self._train(await buffer.batch.call_one(policy_version))

    @endpoint
    async def wait_published(self) -> int:
        """Return once the publish in flight (if any) is complete: generators can fetch the returned version."""
        await self.publisher.wait()
        return self.trainer.policy_version

    @endpoint
    async def score_tokens(self, prompt_ids: list[int], token_ids: list[int]) -> tuple[list[float], int]:
        """The weight-sync canary's trainer side: log-probs at the current weights, and their version."""
        return await self._compute(self.trainer.score_tokens, prompt_ids, token_ids), self.trainer.policy_version

    @endpoint
    async def policy_version(self) -> int:
        return self.trainer.policy_version

    @endpoint
    async def save_checkpoint(self, path: str) -> str:
        return await self._compute(self.trainer.save_checkpoint, path)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        if self._publisher is not None:
            await self._publisher.wait()  # the weights a publish in flight reads are about to change
        await self._compute(self.trainer.load_checkpoint, path)
        return self.trainer.policy_version

    @endpoint
    async def export_hf(self, path: str) -> str:
        return await self._compute(self.trainer.export_hf, path)
