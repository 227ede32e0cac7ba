"""The rollout (rl/rollout.py) without actors (a stand-in generator service): a single-turn one scores with its scorer
or leaves the group unscored, a problem whose generation fails gets its error while the others play, a fatal error ends
the call, a seeded multi-turn call plays each copy with a seed of its own, and completions a generator keeps are
named row by row for the replay buffer to take."""

from __future__ import annotations

import contextlib

import pytest

from forge.service import NoHealthyReplicaError
from rl.environments.config import EnvironmentConfig
from rl.environments.player import EpisodePlayer
from rl.rollout import EPISODE_BITS, Group, MultiTurn, SingleTurn, buffer_episodes
from rl.tasks.arithmetic import ArithmeticTask, Problem
from rl.types import Completion, CompletionBatch, EpisodeBatch, KeptEpisodes, KeptCompletions, SamplingParams


class Generators:
    """Answers prompt p with "<p>!" (each of `params.n` samples); a prompt in `failing` fails its call with `error`."""

    def __init__(self, failing: tuple[str, ...] = (), error: Exception | None = None, replicas: int = 2) -> None:
        self.failing, self.error, self.replicas, self.calls = failing, error, replicas, []
        self.generate_batch = self

    def healthy_replicas(self) -> list[int]:
        return list(range(self.replicas))

    @contextlib.asynccontextmanager
    async def session(self):
        yield self

    async def route(self, prompts, params, min_policy_version=0):
        self.calls.append((list(prompts), params.seed))
        if any(p in self.failing for p in prompts):
            raise self.error
        return CompletionBatch.pack([[Completion(prompt_ids=[1], token_ids=[5], text=f"{p}!", logprobs=[-1.0],
                                                 finish_reason="stop", policy_versions=[0])] * params.n
                                     for p in prompts])


class Scorer:
    failures = 0

    async def score(self, texts: list[str], answer: str) -> list[float]:
        return [float(text == answer) for text in texts]


PROBLEMS = [Problem("a", "a!"), Problem("b", "x"), Problem("c", "c!")]


async def test_single_turn_groups_are_scored_or_left_for_the_caller_to_score():
    generators = Generators()
    groups = await SingleTurn(generators, Scorer()).play_groups(PROBLEMS, SamplingParams(n=2))
    assert [g.rewards for g in groups] == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert len(generators.calls) == 2  # one call per healthy replica
    unscored = await SingleTurn(Generators()).play_groups(PROBLEMS, SamplingParams(n=2))
    assert all(isinstance(g, Group) and g.rewards == [] and g.failed == [False, False] for g in unscored)
    assert [list(g.samples.texts) for g in unscored] == [["a!", "a!"], ["b!", "b!"], ["c!", "c!"]]


async def test_a_failed_problem_gets_its_error_and_the_others_play_on():
    rollout = SingleTurn(Generators(failing=("b",), error=ValueError("prompt too long")), Scorer())
    a, b, c = await rollout.play_groups(PROBLEMS, SamplingParams(n=1))
    assert isinstance(b, ValueError) and str(b) == "prompt too long"
    assert a.rewards == [1.0] and c.rewards == [1.0]


async def test_a_fatal_error_ends_the_call():
    rollout = SingleTurn(Generators(failing=("b",), error=NoHealthyReplicaError("none left")), Scorer())
    with pytest.raises(NoHealthyReplicaError):
        await rollout.play_groups(PROBLEMS, SamplingParams(n=1))


class Done:
    """An environment whose episode ends after the model's first turn, scored 1."""

    async def reset(self, problem) -> str:
        return problem.prompt

    async def step(self, action: str):
        from rl.environments.protocol import StepResult

        return StepResult(observation="", reward=1.0, done=True)


class OneTurnTask(ArithmeticTask):
    def environment(self) -> Done:
        return Done()


class Tokenizer:
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [10 + ord(c) % 50 for c in text]


async def test_a_seeded_multi_turn_call_plays_each_copy_with_its_own_seed():
    generators = Generators(replicas=1)
    rollout = MultiTurn(EpisodePlayer(OneTurnTask(seed=0), Tokenizer(), EnvironmentConfig(), generators))
    (group,) = await rollout.play_groups([Problem("a", "a!")], SamplingParams(n=3, max_tokens=2, seed=5))
    assert group.rewards == [1.0] * 3 and group.failed == [False] * 3
    assert [seed for _, seed in generators.calls] == [15, 16, 17]  # 5 * 3 + j
    generators.calls.clear()
    await rollout.play_groups([Problem("a", "a!")], SamplingParams(n=3, max_tokens=2))
    assert [(len(prompts), seed) for prompts, seed in generators.calls] == [(3, None)]  # unseeded: the copies at once


class KeepingGenerators(Generators):
    """`generate_kept` as a service routes it: each call's completions kept by the replica that answered (the calls
    go to replicas "r0", "r1" in turn), answered with their texts and a key."""

    def __init__(self) -> None:
        super().__init__()
        self.generate_kept, self.keys = self, iter(range(100))

    async def route_replica(self, prompts, params, min_policy_version=0, keep_at_most=None):
        self.calls.append((list(prompts), keep_at_most))
        texts = [f"{p}!" for p in prompts for _ in range(params.n)]
        return KeptCompletions(next(self.keys), [params.n] * len(prompts), texts), f"r{len(self.calls) - 1}"


async def test_kept_completions_are_scored_by_text_and_named_row_by_row_for_the_buffer():
    generators = KeepingGenerators()
    played = await SingleTurn(generators, Scorer(), keep_at_most=8).play_groups(PROBLEMS, SamplingParams(n=2))
    assert [c[1] for c in generators.calls] == [8, 8]  # one call per replica, each naming the bound
    assert [g.rewards for g in played] == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert [(g.samples.generator, g.samples.key, g.samples.rows) for g in played] == [
        ("r0", 0, range(0, 2)), ("r0", 0, range(2, 4)), ("r1", 1, range(0, 2))]
    # Problem "b" trained (group 7), "a" and "c" dropped: r1's batch is named with no rows, to be forgotten.
    episodes = buffer_episodes(played, [(played[1], 7, [0.5, -0.5])])
    assert isinstance(episodes, KeptEpisodes) and len(episodes) == 2
    (r0, r1) = episodes.parts
    assert (r0.generator, r0.key, r0.rows, r0.group_ids, r0.rewards, r0.advantages) == (
        "r0", 0, [2, 3], [7, 7], [0.0, 0.0], [0.5, -0.5])
    assert r0.episode_ids == [7 << EPISODE_BITS, (7 << EPISODE_BITS) + 1]
    assert (r1.key, r1.rows, r1.episode_ids) == (1, [], [])
    # Groups that came with their tensors are packed here, as before (None: nothing to train).
    unkept = await SingleTurn(Generators(), Scorer()).play_groups(PROBLEMS, SamplingParams(n=2))
    assert buffer_episodes(unkept, []) is None
    packed = buffer_episodes(unkept, [(unkept[0], 3, [1.0, -1.0])])
    assert isinstance(packed, EpisodeBatch) and packed.group_ids.tolist() == [3, 3]
    with pytest.raises(TypeError, match="kept on their generator replica"):
        played[0].to_episodes(1, [0.0, 0.0])
    with pytest.raises(ValueError, match="keep_at_most=0: must be None or an int >= 1"):
        SingleTurn(generators, keep_at_most=0)
