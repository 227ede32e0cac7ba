"""The rollout (rl/rollout.py) without actors (a stand-in generator service): a single-turn one scores with its scorer
or leaves the group unscored, a problem whose generation fails gets its error while the others play, a fatal error ends
the call, and a seeded multi-turn call plays each copy with a seed of its own."""

from __future__ import annotations

import contextlib

import pytest

from forge.service import NoHealthyReplicaError
from rl.environments.config import EnvironmentConfig
from rl.environments.player import EpisodePlayer
from rl.rollout import Group, MultiTurn, SingleTurn
from rl.tasks.arithmetic import ArithmeticTask, Problem
from rl.types import Completion, CompletionBatch, SamplingParams


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
