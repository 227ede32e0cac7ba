"""An OpenEnv environment as a multi-turn task (`task.source: openenv`): episodes are the environment's resets.

    task:
      source: openenv
      name: my_pkg.envs:GuessEnvironment     # an openenv.core Environment subclass, used unchanged
      options: {tries: 3}                    # its constructor's keyword arguments
      held_out: 200                          # evaluation episodes: reset seeds [0, held_out)

Training episodes reset with seeds drawn from [held_out, 2**31), so train and evaluation never share a seed.
"""

from __future__ import annotations

import random

from forge.environments.openenv import OpenEnvEnvironment, OpenEnvProblem, OpenEnvSpec

MAX_SEED = 2**31 - 1


class OpenEnvTask:
    stop_token_ids: tuple[int, ...] = ()  # a model turn ends at EOS (which also ends the episode) or max_tokens

    def __init__(self, spec: OpenEnvSpec, *, held_out: int) -> None:
        if not 1 <= held_out < MAX_SEED:
            raise ValueError(f"task.held_out={held_out}: must be in [1, {MAX_SEED})")
        self.spec, self.name = spec, getattr(spec.factory, "__name__", str(spec.factory))
        self._held_out = [self._problem(seed) for seed in range(held_out)]

    def _problem(self, seed: int) -> OpenEnvProblem:
        return OpenEnvProblem(seed=seed, prompt=f"{self.name} reset(seed={seed})", answer=f" {seed}")

    def sample_prompts(self, n: int, rng: random.Random) -> list[OpenEnvProblem]:
        return [self._problem(rng.randint(len(self._held_out), MAX_SEED)) for _ in range(n)]

    def held_out(self) -> list[OpenEnvProblem]:
        return list(self._held_out)

    def environment(self) -> OpenEnvEnvironment:
        return self.spec.environment()

    def transcript(self, problem: OpenEnvProblem) -> list[tuple[str, bool]]:
        """What a multi-turn warm start trains on (forge.warm_start_multiturn): an OpenEnv environment has none."""
        raise ValueError(f"warm_start.enabled=true: task.source='openenv' ({self.name}) has no reference episodes to "
                         "warm start from; set warm_start.enabled: false")

    def reward(self, completion_text: str, answer: str) -> float:
        raise TypeError(f"task.source='openenv' ({self.name}): its environment scores the episodes; there is no "
                        "completion reward")
