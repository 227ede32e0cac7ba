"""bench.controller_path: the synthetic completions make a valid batch, and only the old paths carry the episodes (and
the first the batch) through the controller."""

from types import SimpleNamespace

import torch

from actors.replay_buffer import Added, HandedBatch
from actors.trainer import TrainStepResult
from bench.controller_path import Controller, message_bytes, synthetic_completions
from rl.types import EpisodeBatch, KeptCompletions, KeptEpisodes, TrainBatch


def test_the_synthetic_completions_make_a_batch_of_the_size_asked_for():
    completions = synthetic_completions(2, 16, 4, 10, 3, version=3)
    episodes = EpisodeBatch.from_completions(completions, episode_ids=range(32), group_ids=[0] * 32,
                                             rewards=[0.0] * 32, advantages=[0.0] * 32)
    batch = TrainBatch.from_episodes(episodes, pad_id=0)
    assert batch.input_ids.shape == (32, 14) and batch.response_mask.sum() == 32 * 10
    assert episodes.oldest_policy_versions().tolist() == [3] * 32
    assert [len(text) for text in completions.texts] == [30] * 32


class Handle:
    """A stand-in actor handle: its endpoints are the given methods, and it pickles small as a real one."""

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


async def test_only_the_old_paths_carry_the_episodes_through_the_controller():
    completions = synthetic_completions(4, 16, 8, 128, 4, version=0)
    held = {}

    async def generate_batch(prompts, params, version):
        return completions

    async def generate_kept(prompts, params, version, keep_at_most):
        return KeptCompletions(0, completions.samples.tolist(), list(completions.texts))

    async def add(episodes, reserved, scorer=None, pad_id=0):
        if isinstance(episodes, KeptEpisodes):  # what the buffer takes from the generator
            (part,) = episodes.parts
            episodes = EpisodeBatch.from_completions(completions, episode_ids=part.episode_ids,
                                                     group_ids=part.group_ids, rewards=part.rewards,
                                                     advantages=part.advantages)
        held["episodes"] = episodes
        return Added(len(episodes))

    async def next_batch(version, pad_id):
        held["batch"] = TrainBatch.from_episodes(held["episodes"], pad_id)
        return HandedBatch(version, 64, 0.5, 0.0, {"dropped_too_old": 0})

    async def batch(version):
        return held["batch"]

    async def logprobs(episodes, pad_id):
        return Ranks(torch.zeros(len(episodes.completion_ids)), 1)

    async def train(*args):
        return Ranks(TrainStepResult(1, {"loss": 0.0}), 2)

    generator = Handle("call_one", generate_batch=generate_batch, generate_kept=generate_kept)
    buffer = Handle("call_one", add=add, next_batch=next_batch, batch=batch)
    trainer = Handle("call", train_step=train, train_from=train)
    scorer = Handle("call", logprobs=logprobs)
    old, fetch, direct = (Controller(generator, buffer, trainer, scorer, 16, count_bytes=True) for _ in range(3))
    await old.old_step(64, 0)
    await fetch.fetch_step(64, 0)
    await direct.direct_step(64, 0)
    completions_bytes, texts_bytes = message_bytes(completions), message_bytes(completions.texts)
    episodes_bytes, batch_bytes = message_bytes(held["episodes"]), message_bytes(held["batch"])
    # Old: the completions in, the episodes out twice (the scorer, the buffer) and their log-probs in, the batch in
    # once and out to each of the 2 ranks. Fetch: the completions in and the episodes out once, to the buffer. Direct:
    # the texts in; the rest is handles, versions, ids, rewards, advantages and small answers.
    assert old.counted > completions_bytes + 2 * episodes_bytes + 3 * batch_bytes
    assert completions_bytes + episodes_bytes < fetch.counted < completions_bytes + episodes_bytes + 4096
    assert texts_bytes < direct.counted < texts_bytes + 8192
    assert direct.counted < completions_bytes
