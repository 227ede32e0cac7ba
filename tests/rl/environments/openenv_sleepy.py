"""An OpenEnv environment whose synchronous `step` blocks, as a user's can (`time.sleep` where it waits for a
sandbox): the tests play it in-process and isolated, as `tests.rl.environments.openenv_sleepy:SleepyEnvironment`.

A step sleeps `sleep_s` (blocking its thread) when the model's text starts with "sleep", when the episode's reset seed
is in `block_seeds` (held-out episodes have seeds 0, 1, ...), and on every `block_every`-th step made in its process
(0: none); every step ends the episode, with reward 1 when the model's text starts with
"1" and 0.5 otherwise (partial rewards).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

_steps = itertools.count(1)  # the steps made in this process


class SleepyAction(Action):
    text: str


class SleepyObservation(Observation):
    text: str = ""


class SleepyEnvironment(Environment[SleepyAction, SleepyObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, sleep_s: float = 1000.0, block_every: int = 0, block_seeds: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.sleep_s, self.block_every, self.block_seeds = sleep_s, block_every, tuple(block_seeds)
        self.seed: Optional[int] = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> SleepyObservation:
        self.seed = seed
        return SleepyObservation(text="say 1:")

    def step(self, action: SleepyAction, timeout_s: Optional[float] = None, **kwargs: Any) -> SleepyObservation:
        step = next(_steps)
        if (action.text.startswith("sleep") or self.seed in self.block_seeds
                or (self.block_every and step % self.block_every == 0)):
            time.sleep(self.sleep_s)
        return SleepyObservation(text="", done=True, reward=1.0 if action.text.startswith("1") else 0.5)

    @property
    def state(self) -> State:
        return State()
