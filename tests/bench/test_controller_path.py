"""bench.controller_path: the synthetic episodes are a valid batch, and the old path counts the batch through the
controller where the new one counts handles and versions."""

from types import SimpleNamespace

import torch

from actors.replay_buffer import HandedBatch
from actors.trainer import TrainStepResult
from bench.controller_path import Controller, message_bytes, synthetic_episodes
from rl.types import TrainBatch


def test_the_synthetic_episodes_make_a_batch_of_the_size_asked_for():
    episodes = synthetic_episodes(32, 4, 10, version=3)
    batch = TrainBatch.from_episodes(episodes, pad_id=0)
    assert batch.input_ids.shape == (32, 14) and batch.response_mask.sum() == 32 * 10
    assert episodes.oldest_policy_versions().tolist() == [3] * 32


class Handle:
    """A stand-in actor handle: its endpoints are the owner's `_name` methods, and it pickles small as a real one."""

    def __init__(self, how: str, **methods) -> None:
        for name, method in methods.items():
            setattr(self, name, SimpleNamespace(**{how: method}))

    def __reduce__(self):
        return str, ("handle",)


class Ranks:
    """A mesh's answers, one per rank (what `.call` returns)."""

    def __init__(self, value, ranks: int) -> None:
        self.value, self.ranks = value, ranks

    def values(self):
        return [self.value] * self.ranks


async def test_the_old_path_carries_the_batch_through_the_controller_and_the_new_one_does_not():
    held = {}

    async def add(episodes, reserved, scorer=None, pad_id=0):
        held["episodes"] = episodes
        return len(episodes)

    async def next_batch(version, pad_id):
        held["batch"] = TrainBatch.from_episodes(held["episodes"], pad_id)
        return HandedBatch(version, 64, 0.5, 0.0, {"dropped_too_old": 0})

    async def batch(version):
        return held["batch"]

    async def logprobs(episodes, pad_id):
        return Ranks(torch.zeros(len(episodes.completion_ids)), 1)

    async def train(*args):
        return Ranks(TrainStepResult(1, {"loss": 0.0}), 2)

    buffer = Handle("call_one", add=add, next_batch=next_batch, batch=batch)
    trainer = Handle("call", train_step=train, train_from=train)
    scorer = Handle("call", logprobs=logprobs)
    old, new = (Controller(buffer, trainer, scorer, count_bytes=True) for _ in range(2))
    await old.old_step(synthetic_episodes(64, 8, 128, version=0), 0)
    await new.new_step(synthetic_episodes(64, 8, 128, version=0), 0)
    episodes_bytes = message_bytes(synthetic_episodes(64, 8, 128, version=0))
    batch_bytes = message_bytes(held["batch"])
    # Old: the episodes out twice (the scorer, the buffer) and their log-probs in, the batch in once and out to each
    # of the 2 ranks. New: the episodes out once, to the buffer; the rest is handles, versions and small answers.
    assert old.counted > 2 * episodes_bytes + 3 * batch_bytes
    assert episodes_bytes < new.counted < episodes_bytes + 4096
