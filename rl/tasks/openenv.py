"""An OpenEnv environment as a multi-turn task (`task.source: openenv`): episodes are the environment's resets.

    task:
      source: openenv
      name: my_pkg.envs:GuessEnvironment     # an openenv.core Environment subclass, used unchanged
      options: {tries: 3}                    # its constructor's keyword arguments
      held_out: 200                          # evaluation episodes: reset seeds [0, held_out)

Training episodes reset with seeds drawn from [held_out, 2**31), so train and evaluation never share a seed. A model
turn ends at EOS (which also ends the episode) or after `rollout.max_tokens` tokens: OpenEnv declares no stop texts.
"""

from __future__ import annotations

from rl.environments.openenv import OpenEnvEnvironment, OpenEnvSpec
from rl.tasks.environment import SeededTask


class OpenEnvTask(SeededTask):
    source = "openenv"

    def __init__(self, spec: OpenEnvSpec, *, held_out: int) -> None:
        super().__init__(getattr(spec.factory, "__name__", str(spec.factory)), held_out=held_out)
        self.spec = spec

    def environment(self) -> OpenEnvEnvironment:
        return self.spec.environment()
