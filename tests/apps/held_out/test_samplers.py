"""A multi-turn task through the shared held-out evaluator (pure: a stand-in generator service, the real lookup task and environment):
each sample is an episode its environment scores, its text is the episode after the prompt, an environment's failure
is a failed sample with its reason, and seeded episodes of one prompt get seeds of their own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest

from apps.held_out.evaluate import Progress, Reward, evaluate_task
from apps.held_out.samplers import RolloutSampler
from rl.environments.config import EnvironmentConfig
from rl.environments.openenv import OpenEnvSpec
from rl.environments.player import EpisodePlayer
from rl.environments.threads import stranded_threads
from rl.rollout import MultiTurn
from rl.tasks.lookup import LookupTask
from rl.types import Completion, SamplingParams

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)


class CharTokenizer:
    """One token per character: the lookup task's query character is one token, and decode(encode(t)) == t."""

    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class ScriptedGenerators:
    """A generator service whose model writes `turns[k]` as the k-th completion it is asked for; it records each
    call's seed."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.seeds, self.generate_batch = iter(turns), [], self

    @contextlib.asynccontextmanager
    async def session(self):
        yield self

    def healthy_replicas(self) -> list[int]:
        return [0]

    async def route(self, prompts, params, min_policy_version=0):
        self.seeds.append(params.seed)
        texts = [next(self.turns) for _ in prompts]
        return [[Completion(prompt_ids=list(p), token_ids=CharTokenizer().encode(t), text=t, logprobs=[0.0] * len(t),
                            finish_reason="stop", policy_versions=[0] * len(t))] for p, t in zip(prompts, texts)]


async def evaluate(sampler, problems, params, seed=None) -> tuple[list, list[str | None]]:
    """Each problem's result, and each sample's text as samples.jsonl records it (a task reward that would give 0)."""
    texts: list[str | None] = []
    results = await evaluate_task(sampler, problems, params, Reward(lambda text, answer: 0.0, None), seed=seed,
                                  slots=asyncio.Semaphore(1), progress=Progress("eval test", len(problems), every_s=0),
                                  on_sample=lambda i, problem, text, value, error: texts.append(text))
    return results, texts


async def test_each_sample_is_an_episode_scored_by_its_environment_and_its_text_is_the_episode():
    tokenizer = CharTokenizer()
    task = LookupTask(seed=0, held_out=2, tokenizer=tokenizer)
    problems = task.held_out()
    ask, reply, answer = (text for text, _ in task.transcript(problems[0])[1:])
    # Two episodes of problem 0 play together: both ask, then one answers right and one wrong. Problem 1's pair
    # answers at once, right and wrong (no question: its first turn is the final answer).
    wrong = "0" if answer != "0" else "1"
    turns = [ask, ask, answer, wrong, problems[1].answer, "9" + problems[1].answer]
    generators = ScriptedGenerators(turns)
    sampler = RolloutSampler(MultiTurn(EpisodePlayer(task, tokenizer, EnvironmentConfig(max_turns=3), generators)),
                             tokenizer)
    results, texts = await evaluate(sampler, problems, SamplingParams(n=2, max_tokens=4, stop_token_ids=task.stop_token_ids))
    assert [r.rewards for r in results] == [[1.0, 0.0], [1.0, 0.0]]  # the environment's rewards, not Reward's 0
    assert [r.errors for r in results] == [[], []]
    # the model's turns and the environment's reply between them, as the samples file records them
    assert texts == [ask + reply + answer, ask + reply + wrong, problems[1].answer,
                                                   "9" + problems[1].answer]
    assert generators.seeds == [None, None, None]  # unseeded: each turn of a problem's episodes in one call


async def test_seeded_episodes_get_a_seed_each_and_a_failed_environment_is_a_failed_sample():
    tokenizer = CharTokenizer()
    task = LookupTask(seed=0, held_out=2, tokenizer=tokenizer)
    problems = task.held_out()
    generators = ScriptedGenerators([p.answer for p in problems for _ in range(3)])
    sampler = RolloutSampler(MultiTurn(EpisodePlayer(task, tokenizer, EnvironmentConfig(), generators)), tokenizer)
    results, _ = await evaluate(sampler, problems, SamplingParams(n=3, max_tokens=4), seed=10)
    assert [r.rewards for r in results] == [[1.0] * 3, [1.0] * 3]
    # prompt i has seed 10 + i; its episode j plays with (10 + i) * 3 + j: three different episodes, not one thrice
    assert generators.seeds == [30, 31, 32, 33, 34, 35]

    # An environment whose step raises: the sample fails with the environment's reason and is not scored.
    spec = OpenEnvSpec.resolve("tests.rl.environments.openenv_sleepy:SleepyEnvironment", options={"sleep_s": 1.0})
    failing = SimpleNamespace(environment=spec.environment)
    sampler = RolloutSampler(MultiTurn(EpisodePlayer(failing, tokenizer, EnvironmentConfig(step_timeout_s=0.3),
                                                     ScriptedGenerators(["1", "sleep"]))), tokenizer)
    (result,), _ = await evaluate(sampler, [SimpleNamespace(seed=1, prompt="p", answer="a")],
                               SamplingParams(n=2, max_tokens=1))
    assert result.rewards == [1.0]
    assert len(result.errors) == 1 and result.errors[0].startswith("EnvironmentFailed: "), result.errors
    deadline = time.monotonic() + 15  # the blocked step's thread ends with its sleep: none left for the next test
    while stranded_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
