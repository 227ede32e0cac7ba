"""RolloutScheduler: the fill loop generates what the buffer has room for, the train loop trains each batch on the
newest version with the trainer fetching it from the buffer, and either loop's end ends the other.

The actors are in-process stand-ins with the endpoints the scheduler calls (`endpoint.call_one` / `.call`), the buffer
a real ReplayBuffer; the Monarch path is exercised end to end by tests/apps/grpo/test_main.py."""

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from actors.replay_buffer import Added, HandedBatch, ReplayBuffer, score_episodes
from actors.trainer import TrainStepResult
from apps.grpo.scheduler import RolloutScheduler, TrainedStep
from rl.types import Episode, EpisodeBatch, TrainBatch


def make_episodes(first_id: int, count: int, version: int) -> EpisodeBatch:
    return EpisodeBatch.pack([Episode(episode_id=first_id + i, group_id=(first_id + i) // 2, prompt_ids=[1, 2],
                                      completion_ids=[3], behaviour_logprobs=[-0.5], policy_versions=[version],
                                      reward=float(i % 2)) for i in range(count)])


def endpoints(owner, *names: str, how: str = "call_one") -> None:
    for name in names:
        setattr(owner, name, SimpleNamespace(**{how: getattr(owner, f"_{name}")}))


class InProcessBuffer:
    """ReplayBufferActor's endpoints on an in-process ReplayBuffer."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer, self.calls, self.handed = buffer, Counter(), None
        endpoints(self, "reserve", "add", "next_batch", "batch")

    async def _reserve(self, *args):
        self.calls["reserve"] += 1
        return self.buffer.reserve(*args)

    async def _add(self, episodes, reserved: int, scorer, pad_id: int, top_k: int = 0):
        self.calls["add"] += 1
        if scorer is not None and episodes is not None:
            await score_episodes(episodes, scorer, pad_id, top_k)
        self.buffer.add(episodes if episodes is not None else [], reserved)
        return Added(len(self.buffer))

    async def _next_batch(self, version: int, pad_id: int):
        await asyncio.sleep(0)
        episodes = self.buffer.sample(version)
        if episodes is None:
            return None
        self.handed = (version, TrainBatch.from_episodes(episodes, pad_id))
        return HandedBatch(version, len(episodes), float(episodes.rewards.mean()), 0.0, self.buffer.stats)

    async def _batch(self, version: int):
        assert self.handed[0] == version
        return self.handed[1]


class InProcessTrainer:
    """TrainerActor's `train_from`: fetches the batch from the buffer it is given, returns the next version."""

    def __init__(self) -> None:
        self.trained: list[tuple[int, TrainBatch]] = []
        endpoints(self, "train_from", how="call")

    async def _train_from(self, buffer, version: int) -> TrainStepResult:
        batch = await buffer.batch.call_one(version)
        self.trained.append((version, batch))
        await asyncio.sleep(0.01)
        return TrainStepResult(version + 1, {"loss": 0.0})


class Ranks:
    """What an endpoint called on a mesh answers: each rank's value (forge.endpoints.rank0 takes rank 0's)."""

    def __init__(self, by_rank: dict) -> None:
        self.by_rank = by_rank

    def values(self):
        return iter(self.by_rank.values())


class ZeroScorer:
    """The reference actor's endpoints on one rank: log-prob 0 for every token; its top-k, token ids 0..k-1 at log-prob
    -1 and the rest at -2."""

    def __init__(self) -> None:
        self.scored, self.top_ks = 0, []
        endpoints(self, "logprobs", "topk_logprobs", how="call")

    async def _logprobs(self, episodes: EpisodeBatch, pad_id: int) -> Ranks:
        self.scored += len(episodes)
        return Ranks({0: torch.zeros(len(episodes.completion_ids))})

    async def _topk_logprobs(self, episodes: EpisodeBatch, pad_id: int, k: int) -> Ranks:
        self.scored += len(episodes)
        self.top_ks.append(k)
        tokens = len(episodes.completion_ids)
        return Ranks({0: (torch.zeros(tokens), torch.arange(k, dtype=torch.int32).repeat(tokens, 1),
                          torch.cat([torch.full((tokens, k), -1.0), torch.full((tokens, 1), -2.0)], dim=1))})


def scheduler(batch_size: int = 4, max_policy_age: int = 0, scorer=None, teacher_top_k: int = 0) -> RolloutScheduler:
    return RolloutScheduler(InProcessBuffer(ReplayBuffer(batch_size=batch_size, max_policy_age=max_policy_age)),
                            InProcessTrainer(), scorer, pad_id=0, group_size=2, max_groups_in_flight=4,
                            teacher_top_k=teacher_top_k)


async def test_it_generates_what_the_buffer_has_room_for_and_the_trainer_fetches_each_batch_on_policy():
    # Age 0, batches of 2 groups of 2: every batch is trained on the version that made it, each generating call is
    # one call for all the groups granted at once, and one call whose groups were all dropped (None) gives its room
    # back. The scorer scores every episode added, and the trainer gets the buffer and a version, not a batch.
    scorer = ZeroScorer()
    s = scheduler(scorer=scorer)
    made, steps, ids = [], [], iter(range(1000))

    async def generate(count: int, version: int) -> EpisodeBatch | None:
        made.append((count, version))
        await asyncio.sleep(0.01)
        return make_episodes(next(ids) * 100, 2 * count, version) if len(made) != 2 else None  # the 2nd: dropped

    async def on_step(step: TrainedStep) -> None:
        steps.append(step)

    s.published(0, steps_left=3)
    await asyncio.wait_for(s.run(generate, steps=3, on_step=on_step), 10)
    assert [(step.trained_on, step.result.version, step.batch.episodes) for step in steps] == [(0, 1, 4), (1, 2, 4),
                                                                                                (2, 3, 4)]
    trained = s.trainer.trained
    assert [version for version, _ in trained] == [0, 1, 2]
    assert all(batch.policy_versions.max() == version for version, batch in trained)  # strictly on-policy
    assert all(batch.ref_logprobs is not None for _, batch in trained)  # scored in the buffer, on the way in
    assert scorer.scored == s.buffer.buffer.stats["added"]
    assert made[0] == (2, 0) and all(count <= 2 for count, _ in made)
    assert s.stopped and await s.next_batch() is None
    assert s.buffer.calls["add"] == len(made) and s.buffer.buffer.in_flight == 2 * s.groups_in_flight


async def test_with_teacher_top_k_the_scorer_hands_its_top_k_to_every_batch_the_trainer_gets():
    scorer = ZeroScorer()
    s = scheduler(scorer=scorer, teacher_top_k=3)
    ids = iter(range(1000))

    async def generate(count: int, version: int) -> EpisodeBatch:
        return make_episodes(next(ids) * 100, 2 * count, version)

    async def on_step(step: TrainedStep) -> None:
        pass

    s.published(0, steps_left=2)
    await asyncio.wait_for(s.run(generate, steps=2, on_step=on_step), 10)
    assert scorer.top_ks and set(scorer.top_ks) == {3}
    for _, batch in s.trainer.trained:  # the one completion token is predicted at position 1
        assert batch.ref_topk_ids.shape == (4, 2, 3) and batch.ref_topk_logprobs.shape == (4, 2, 4)
        assert batch.ref_topk_ids[:, 1].tolist() == [[0, 1, 2]] * 4
        assert batch.ref_topk_logprobs[:, 1].tolist() == [[-1.0, -1.0, -1.0, -2.0]] * 4
        assert batch.ref_logprobs is not None


async def test_a_failing_generate_ends_the_run_with_its_error():
    s = scheduler()

    async def generate(count: int, version: int) -> None:
        raise RuntimeError("no healthy generator left")

    async def on_step(step: TrainedStep) -> None:
        raise AssertionError("no batch can come")

    s.published(0, steps_left=3)
    with pytest.raises(RuntimeError, match="no healthy generator left"):
        await asyncio.wait_for(s.run(generate, steps=3, on_step=on_step), 10)
    assert s.stopped


async def test_stop_ends_the_run_after_the_step_in_progress():
    # A signal during step 2 (the job's request_stop): the step finishes, no later one starts, generation ends.
    s, steps = scheduler(max_policy_age=1), []

    async def generate(count: int, version: int) -> EpisodeBatch:
        await asyncio.sleep(0.01)
        return make_episodes(1000 * version + 10 * len(steps), 2 * count, version)

    async def on_step(step: TrainedStep) -> None:
        steps.append(step.trained_on)
        if len(steps) == 2:
            s.stop()
            await asyncio.sleep(0.05)  # the rest of the step (logging, a checkpoint) still runs

    s.published(0, steps_left=10)
    await asyncio.wait_for(s.run(generate, steps=10, on_step=on_step), 10)
    assert steps == [0, 1] and len(s.trainer.trained) == 2


async def test_a_run_of_zero_steps_or_stopped_before_it_starts_trains_nothing():
    for steps, stop_first in ((0, False), (3, True)):
        s = scheduler()
        if stop_first:
            s.stop()

        async def generate(count: int, version: int) -> EpisodeBatch:
            return make_episodes(0, 2 * count, version)

        async def on_step(step: TrainedStep) -> None:
            raise AssertionError("nothing to train")

        s.published(0, steps_left=steps)
        await asyncio.wait_for(s.run(generate, steps=steps, on_step=on_step), 10)
        assert s.trainer.trained == []


async def test_episodes_the_buffer_could_not_take_from_their_generator_are_reported_to_the_job():
    # A replica that died between generating and the buffer's take: the job counts those groups as failed generations.
    added, lost = [Added(3, lost_episodes=2, lost_groups=1), Added(5)], []

    async def add(episodes, reserved: int, scorer, pad_id: int, top_k: int = 0) -> Added:
        return added.pop(0)

    buffer = SimpleNamespace(add=SimpleNamespace(call_one=add))
    s = RolloutScheduler(buffer, InProcessTrainer(), None, pad_id=0, group_size=2, max_groups_in_flight=4,
                         on_lost=lost.append)

    async def generate(count: int, version: int) -> None:
        return None

    s.groups_in_flight = 2
    await s.rollout(generate, 1, 0)
    await s.rollout(generate, 1, 0)
    assert lost == [Added(3, lost_episodes=2, lost_groups=1)] and s.groups_in_flight == 0
