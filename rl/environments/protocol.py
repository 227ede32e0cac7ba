"""The environment protocol: what a multi-turn task implements (a tool is one too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Text (encoded once, by the rollout's tokenizer; in chat mode as a user message of the model's chat template) or token
# ids (appended as they are, in chat mode too).
Observation = str | list[int]


@dataclass
class StepResult:
    observation: Observation  # what the model reads next (ignored when done)
    reward: float = 0.0  # the episode's reward is the sum of its steps' rewards
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. The rollout calls `reset` once, then `step` with each model turn's text until
    `done` or a limit (environment.max_turns, max_total_tokens). Both are coroutines run under the step timeout.
    apps.grpo runs each episode's environment on a thread of its own (rl.environments.threads), so one that
    blocks its thread costs its episode only; a crash of its process is contained by isolating it in an actor
    (rl.environments.actor, `environment.isolated`)."""

    async def reset(self, problem: Any) -> Observation:
        """Start an episode of `problem` (one of its task's problems: each task has its own problem type, so `Any`
        here); returns the first prompt."""
        ...

    async def step(self, action: str) -> StepResult:
        """The model's turn (its text, up to and including its stop token's text)."""
        ...

    # Optional: `async def close(self) -> None`, awaited once when the episode ends, however it ended (done, a
    # limit, EOS, a failure), to release what the environment holds (a server session, a sandbox).
