"""A small OpenEnv environment, written only against OpenEnv's own base classes (no forge import): the tests train
it through forge's adapter (rl/environments/openenv.py) as `tests.rl.environments.openenv_guess:GuessEnvironment`.

reset(seed) hides a digit and shows "guess 0-9:"; each turn the agent guesses; a wrong guess reads "up;" or "down;",
the right one ends the episode with reward 1; after `tries` wrong guesses the episode ends with reward 0.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str = ""
    tries_left: int = 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance holds its own episode: a server may run several at once

    def __init__(self, tries: int = 3) -> None:
        super().__init__()
        self.tries, self.secret, self._state = tries, 0, State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(0, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="guess 0-9:", tries_left=self.tries)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        tries_left = self.tries - self._state.step_count
        guess = action.guess.strip()[:1]
        if guess == str(self.secret):
            return GuessObservation(text="", done=True, reward=1.0, tries_left=tries_left, metadata={"solved": True})
        hint = "up;" if guess.isdigit() and int(guess) < self.secret else "down;"
        return GuessObservation(text=hint, done=tries_left <= 0, reward=0.0, tries_left=tries_left,
                                metadata={"solved": False})

    @property
    def state(self) -> State:
        return self._state


class TwoTextAction(Action):
    """An Action with two text fields: the adapter needs `action_field` to pick one."""

    command: str
    note: str = ""


class TwoTextEnvironment(Environment):
    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(text=f"seed {seed}")

    def step(self, action: TwoTextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(text=action.command.upper(), done=True, reward=0.5)

    @property
    def state(self) -> State:
        return State()


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """OpenEnv's client of a served GuessEnvironment (`create_app(GuessEnvironment, GuessAction, GuessObservation)`)."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(**payload.get("observation", {}), done=payload.get("done", False),
                                       reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
