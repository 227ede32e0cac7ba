"""EpisodePlayer (rl.environments.player): every turn of a play() call goes through one generator session and asks
for the policy version it was given; each distinct text is tokenized once."""

from __future__ import annotations

import asyncio
import contextlib

from rl.environments.config import EnvironmentConfig
from rl.environments.player import EpisodePlayer
from rl.environments.protocol import StepResult
from rl.types import Completion, SamplingParams

EOS = 1


class Tokenizer:
    eos_token_id = EOS

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(text)
        return [100 + ord(c) for c in text]


class Generators:
    """A generator service: `session()` pins a caller to one replica; `generate_batch.route` samples. Records the
    session each call came in and the policy version it asked for."""

    def __init__(self, version: int) -> None:
        self.version, self.open_sessions, self.sessions_opened = version, 0, 0
        self.calls: list[tuple[int, int, int]] = []  # (prompts, min_policy_version, open sessions)
        self.generate_batch = self

    @contextlib.asynccontextmanager
    async def session(self):
        self.sessions_opened += 1
        self.open_sessions += 1
        try:
            yield
        finally:
            self.open_sessions -= 1

    async def route(self, prompts: list[list[int]], params: SamplingParams, min_policy_version: int) -> list:
        self.calls.append((len(prompts), min_policy_version, self.open_sessions))
        tokens = [7, 8]  # no EOS: the environment ends the episode
        return [[Completion(prompt_ids=list(p), token_ids=tokens, text="go", logprobs=[-0.1] * len(tokens),
                            finish_reason="stop", policy_versions=[self.version] * len(tokens))] for p in prompts]


class TwoTurnEnvironment:
    async def reset(self, problem: str) -> str:
        self.turns = 0
        return f"find {problem}"

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        done = self.turns == 2
        return StepResult(observation="ok", reward=1.0 if done else 0.0, done=done)


class Task:
    environment = TwoTurnEnvironment


def play(problems: list[str], version: int, generators: Generators, tokenizer: Tokenizer) -> list:
    player = EpisodePlayer(Task(), tokenizer, EnvironmentConfig(max_turns=4, max_total_tokens=256), generators)
    return asyncio.run(player.play(problems, SamplingParams(max_tokens=8), version=version))


def test_every_turn_goes_through_one_session_at_the_version_asked_for():
    generators, tokenizer = Generators(version=5), Tokenizer()
    trajectories = play(["a", "b", "c"], 5, generators, tokenizer)

    assert [t.end for t in trajectories] == ["done"] * 3
    assert [t.reward for t in trajectories] == [1.0] * 3
    assert generators.sessions_opened == 1 and generators.open_sessions == 0
    assert sum(n for n, _, _ in generators.calls) == 6  # 3 episodes x 2 model turns
    assert {(version, sessions) for _, version, sessions in generators.calls} == {(5, 1)}
    for problem, t in zip("abc", trajectories):
        assert t.prompt_ids == [100 + ord(c) for c in f"find {problem}"]
        assert [v for v, m in zip(t.versions, t.mask) if m] == [5] * 4  # 2 turns x 2 tokens


def test_each_distinct_text_is_tokenized_once():
    tokenizer = Tokenizer()
    play(["a", "b", "a"], 0, Generators(version=0), tokenizer)

    assert sorted(tokenizer.encoded) == ["find a", "find b", "ok"]
