"""A multi-turn task's episodes played through forge's generator service: what GRPO trains on and what apps.eval
scores, by one piece of code.

    player = await start_player(task, tokenizer, limits, generators)  # its environment host too, when isolated
    trajectories = await player.play(problems, params)               # one episode per problem, all at once

Every turn of one call goes to one replica (a service session), and so does every environment call when the
environments run on their own host (`limits.isolated`): the episodes' state lives there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from rl.environments.actor import EnvironmentHost, RemoteEnvironment
from rl.environments.chat import ChatTemplate
from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from rl.environments.threads import ThreadedEnvironment
from rl.environments.trajectory import Trajectory
from rl.tasks.protocol import MultiTurnTask, TaskProblem
from rl.types import SamplingParams


class EpisodePlayer:
    """`task.environment()` makes each episode's environment: on a thread of this process, or on `hosts`."""

    def __init__(self, task: MultiTurnTask, tokenizer: Any, limits: EnvironmentConfig, generators: Any,
                 hosts: Any | None = None, chat_template_kwargs: dict | None = None) -> None:
        self.task, self.limits, self.generators, self.hosts = task, limits, generators, hosts
        # Prompts and observations repeat (a task's few hundred prompts, a tool's short replies): each distinct text
        # is tokenized once. Encoding is deterministic, so the ids are the same as encoding it again.
        encoded = functools.lru_cache(maxsize=1 << 16)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))
        self.encode = lambda text: list(encoded(text))
        self.end_token_ids = [tokenizer.eos_token_id]
        # limits.chat_template: turns wrapped by the model's chat template, by token ids (rl.environments.chat)
        self.chat = (ChatTemplate(tokenizer, system_prompt=limits.system_prompt,
                                  chat_template_kwargs=chat_template_kwargs)
                     if limits.chat_template else None)

    def environments(self, n: int) -> list:
        return [RemoteEnvironment(self.hosts) if self.hosts else ThreadedEnvironment(self.task.environment)
                for _ in range(n)]

    async def play(self, problems: Sequence[TaskProblem], params: SamplingParams, version: int = 0) -> list[Trajectory]:
        """One episode per problem, all at once, every turn generated with policy `version` or newer."""

        async def generate(prompts: list[list[int]], turn_params: SamplingParams) -> list:
            outputs = await self.generators.generate_batch.route(prompts, turn_params, min_policy_version=version)
            return [out[0] for out in outputs]

        async with self.generators.session(), (self.hosts.session() if self.hosts else contextlib.nullcontext()):
            return await run_episodes(generate, self.environments(len(problems)), problems, params, self.limits,
                                      self.encode, self.end_token_ids, chat=self.chat)


async def start_player(task: MultiTurnTask, tokenizer: Any, limits: EnvironmentConfig, generators: Any,
                       chat_template_kwargs: dict | None = None, mesh_name: str = "environments") -> EpisodePlayer:
    """The task's player, its environments on threads of this process or, with `limits.isolated`, on an environment
    host process of their own (a service named `mesh_name`, started here)."""
    hosts = None
    if limits.isolated:
        hosts = await EnvironmentHost.options(num_replicas=1, mesh_name=mesh_name).as_service(task.environment)
    return EpisodePlayer(task, tokenizer, limits, generators, hosts, chat_template_kwargs)
