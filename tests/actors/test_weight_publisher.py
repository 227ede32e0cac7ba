"""Publishing policy versions (actors.weight_publisher, TrainerActor): off the training step's critical path,
advertised only once complete, in the generators' dtype, from every rank of an FSDP trainer."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from actors.titan_trainer import TitanTrainer
from actors.trainer import TrainerActor
from actors.trainer_config import TrainerConfig
from actors.weight_publisher import WeightPublisher
from forge.weights import segment
from forge.weights.manifest import SharedMemoryError
from forge.actor import ForgeActor, rank0
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Episode, TrainBatch
from forge.weights.store import WeightStore
from forge.weights.startup import start_weight_store

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
async def store() -> WeightStore:
    await start_weight_store()
    return WeightStore("publisher-test")


def episodes(seed: int, rows: int = 4) -> list[Episode]:
    generator = torch.Generator().manual_seed(seed)
    return [Episode(episode_id=i, group_id=0, prompt_ids=torch.randint(3, 99, (4,), generator=generator).tolist(),
                    completion_ids=torch.randint(3, 99, (5,), generator=generator).tolist(),
                    behaviour_logprobs=[-4.0] * 5, policy_versions=[0] * 5, reward=float(i % 2),
                    advantage=1.0 if i % 2 else -1.0)
            for i in range(rows)]


def batch(seed: int) -> TrainBatch:
    return TrainBatch.from_episodes(episodes(seed), pad_id=0)


def trainer_for(checkpoint: Path) -> TitanTrainer:
    return TitanTrainer(TrainerConfig(model_path=str(checkpoint), lr=1e-3, loss="grpo"))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Shared-memory writes wait until the test sets this event: a publish held in flight."""
    opened = threading.Event()
    write = segment.SegmentWriter.write_piece

    def gated_write(self, *args, **kwargs) -> int:
        assert opened.wait(timeout=120), "the test never opened the gate"
        return write(self, *args, **kwargs)

    monkeypatch.setattr(segment.SegmentWriter, "write_piece", gated_write)
    yield opened
    opened.set()


async def test_publish_overlaps_the_next_step_and_is_advertised_once_complete(store, checkpoint, gate):
    trainer = trainer_for(checkpoint)
    publisher = WeightPublisher(store, dtype=torch.bfloat16, keep_versions=2)
    trainer.train_step(batch(1))
    published = {name: t.to(torch.bfloat16) for name, t in trainer.hf_state_dict().items()}
    publisher.start(trainer.hf_state_dict_shards(), 1, trainer.optimizers)

    forwarded = threading.Event()
    hook = trainer.model.register_forward_hook(lambda *_: forwarded.set())
    next_step = asyncio.ensure_future(asyncio.to_thread(trainer.train_step, batch(2)))
    try:
        assert await asyncio.to_thread(forwarded.wait, 60)  # the next step's forward pass runs meanwhile
        await asyncio.sleep(0.3)
        # ... but its optimizer waits: the publish has not read the weights yet, and nobody sees version 1.
        assert not next_step.done() and trainer.step == 1
        assert 1 not in await store.versions() and await store.latest_version() != 1
    finally:
        hook.remove()
        gate.set()
    assert await publisher.wait() == 1
    await next_step
    assert trainer.policy_version == 2
    assert await store.latest_version() == 1
    fetched = await store.fetch(1)
    assert {t.dtype for t in fetched.values()} == {torch.bfloat16}
    for name, tensor in published.items():  # the weights of step 1, not torn by step 2
        assert torch.equal(fetched[name], tensor), name
    assert not torch.equal(trainer.hf_state_dict()["lm_head.weight"].to(torch.bfloat16), fetched["lm_head.weight"])


async def test_an_optimizer_step_on_the_publishing_loop_is_an_error_not_a_hang(store, checkpoint, gate):
    trainer = trainer_for(checkpoint)
    publisher = WeightPublisher(store, dtype=torch.float32, keep_versions=2)
    publisher.start(trainer.hf_state_dict_shards(), 5, trainer.optimizers)
    with pytest.raises(RuntimeError, match=r"await WeightPublisher.wait\(\) first"):
        trainer.train_step(batch(3))  # on this thread, whose event loop runs the publish
    gate.set()
    assert await publisher.wait() == 5
    publisher.start(trainer.hf_state_dict_shards(), 6, trainer.optimizers)
    with pytest.raises(RuntimeError, match="a version is still being published"):
        publisher.start(trainer.hf_state_dict_shards(), 7, trainer.optimizers)
    assert await publisher.wait() == 6


async def test_a_failed_publish_is_raised_by_the_next_wait(store, checkpoint, monkeypatch):
    trainer = trainer_for(checkpoint)
    publisher = WeightPublisher(store, dtype=torch.float32, keep_versions=2)
    monkeypatch.setattr(segment, "shm_free_bytes", lambda: 0)
    store._spare_path().unlink(missing_ok=True)  # no deleted version's file to reuse either
    publisher.start(trainer.hf_state_dict_shards(), 8, trainer.optimizers)
    with pytest.raises(SharedMemoryError, match="policy version 8 needs"):
        await publisher.wait()
    assert await publisher.wait() is None  # raised once; the optimizer is free again
    trainer.train_step(batch(4))
    assert trainer.policy_version == trainer.step == 1


async def _wait_for_latest(store: WeightStore, version: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await store.latest_version() != version:
        assert time.monotonic() < deadline, f"version {version} never advertised; latest {await store.latest_version()}"
        await asyncio.sleep(0.05)


async def test_trainer_actor_on_two_ranks_publishes_every_version_in_the_publish_dtype(store, checkpoint, tmp_path):
    config = TrainerConfig(model_path=str(checkpoint), lr=1e-3, loss="grpo", publish_dtype="bfloat16")
    trainer = await TrainerActor.options(procs=2).as_actor(config, weight_namespace="actor-test", keep_versions=2)
    actor_store = WeightStore("actor-test")
    try:
        assert rank0(await trainer.publish_weights.call()) == 0
        initial = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
        v0 = await actor_store.fetch(0)
        assert v0.keys() == initial.keys()
        for name, tensor in v0.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, initial[name].to(torch.bfloat16)), name

        for version in (1, 2):
            result = rank0(await trainer.train_step.call(batch(version)))
            assert result.version == version and result.metrics["publish_wait_s"] >= 0
            await _wait_for_latest(actor_store, version)
        exported = load_file(Path(rank0(await trainer.export_hf.call(str(tmp_path / "export")))) / "model.safetensors")
        v2 = await actor_store.fetch(2)
        for name, tensor in v2.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, exported[name].to(torch.bfloat16)), name
        assert await actor_store.versions() == [1, 2]  # keep_versions=2
    finally:
        await ForgeActor.shutdown(trainer)
        for version in await actor_store.versions():
            await actor_store.delete(version)
