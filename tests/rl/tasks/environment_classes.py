"""Environment classes that break forge's Environment protocol in the ways a config check must catch
(tests/rl/tasks/test_environment.py). The working one is docs/examples/lookup_env.py."""

from __future__ import annotations

from typing import Any

from rl.environments.protocol import StepResult


class SyncStep:
    async def reset(self, problem: Any) -> str:
        return "go"

    def step(self, action: str) -> StepResult:  # not a coroutine: `await env.step(...)` would fail every episode
        return StepResult(observation="", done=True)


class NoStep:
    async def reset(self, problem: Any) -> str:
        return "go"


class StepWithoutAction:
    async def reset(self, problem: Any) -> str:
        return "go"

    async def step(self) -> StepResult:
        return StepResult(observation="", done=True)


class SyncClose(SyncStep):
    async def step(self, action: str) -> StepResult:
        return StepResult(observation="", done=True)

    def close(self) -> None:
        pass


class Good:
    async def reset(self, problem: Any) -> str:
        return f"seed {problem.seed}"

    async def step(self, action: str) -> StepResult:
        return StepResult(observation="", reward=1.0, done=True)


class StopTextsNotATuple(Good):
    stop_texts = "?"


class TwoTokenStopText(Good):
    stop_texts = ("?", "c?")


class RequiredOption(Good):
    def __init__(self, size: int, tries: int = 3) -> None:
        self.size, self.tries = size, tries


class AnyOption(Good):
    def __init__(self, **options: Any) -> None:
        self.options = options


def not_a_class() -> Good:
    return Good()
