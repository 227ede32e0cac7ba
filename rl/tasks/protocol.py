"""What a task is, as the apps use it: `Task` (single-turn) and `MultiTurnTask` (played against environments).

    task = make_task(config, seed=..., model=...)        # rl.tasks: one of forge's tasks, typed `Task`
    problems = task.sample_prompts(n, rng)               # training problems, each with `prompt` and `answer`
    reward = task.reward(completion_text, problem.answer)
    if isinstance(task, MultiTurnTask):                  # its episodes are played against `task.environment()`
        ...

Both are structural (typing.Protocol): a class satisfies them by having the members, with no base class to inherit.
They are runtime-checkable, so `isinstance(task, MultiTurnTask)` is how code tells a multi-turn task from a
single-turn one (it checks that the members exist, not their signatures; mypy checks those:
tests/rl/tasks/test_protocol.py). Every task `rl.tasks.make_task` builds satisfies `Task`, and those of the
multi-turn sources (`TaskConfig.multi_turn`) satisfy `MultiTurnTask`.

(The name `MultiTurnTask`, not `EnvironmentTask`: `rl.tasks.environment.EnvironmentTask` is the concrete task of a
user's environment class, one of the multi-turn tasks.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

from rl.environments.protocol import Environment


@runtime_checkable
class TaskProblem(Protocol):
    """One problem of a task: the text the model is prompted with (a multi-turn task's: a label of the episode, whose
    environment makes the first prompt) and the reference answer its reward compares against (a key, for tasks whose
    reward needs more than a text: rl.tasks.reasoning_gym). Every task's problems are NamedTuples with these fields."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


# A task's own problem type (arithmetic's Problem, lookup's LookupProblem, ...): `Task` alone means any problems.
P_co = TypeVar("P_co", bound=TaskProblem, covariant=True)
P = TypeVar("P", bound=TaskProblem)


@runtime_checkable
class Task(Protocol[P_co]):
    """A task whose problems a model answers in one completion, scored by `reward`."""

    @property
    def stop_token_ids(self) -> Sequence[int]:
        """Tokens that end an answer besides EOS (a chat template's end of turn; a multi-turn task's: a model turn)."""
        ...

    def sample_prompts(self, n: int, rng: random.Random) -> Sequence[P_co]:
        """`n` training problems drawn with `rng` (never held-out ones)."""
        ...

    def held_out(self) -> Sequence[P_co]:
        """The fixed evaluation problems, in a deterministic order."""
        ...

    def reward(self, completion_text: str, answer: str) -> float:
        """The completion's score against a problem's `answer` (a multi-turn task's environment scores its episodes;
        its `reward`, if it has one of its own, scores a final turn, and otherwise raises)."""
        ...


@runtime_checkable
class MultiTurnTask(Task[P], Protocol[P]):
    """A task whose episodes are played against an environment, which scores them (rl.environments). (Its problem type
    is invariant: `transcript` takes the task's own problems.)"""

    def environment(self) -> Environment:
        """A fresh environment for one episode."""
        ...

    def transcript(self, problem: P) -> list[tuple[str, bool]]:
        """A correct episode of `problem` as (text, written by the model) segments, for a supervised warm start
        (apps.warm_start.multiturn); a task without reference episodes raises ValueError naming warm_start.enabled."""
        ...


__all__ = ["MultiTurnTask", "Task", "TaskProblem"]
