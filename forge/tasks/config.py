"""Which task a job trains on, as its config's `task` section (plain Python: checked before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FORGE_TASKS = ("arithmetic", "gsm8k", "lookup")


@dataclass
class TaskConfig:
    # "forge": a task of forge's own (`name`: arithmetic, gsm8k, or lookup: multi-turn, forge/tasks/lookup.py);
    # "reasoning_gym": any reasoning-gym dataset by its name, with `options` passed to it and its own scorer as the
    # reward; "openenv": an OpenEnv environment used unchanged (`name`: 'package.module:Class', `options`: its
    # constructor's keyword arguments; forge/tasks/openenv.py), multi-turn.
    source: Literal["forge", "reasoning_gym", "openenv"] = "forge"
    name: str = "arithmetic"
    options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym: the dataset's config fields; openenv: kwargs
    size: int = 10_000  # reasoning_gym: training problems generated (held-out ones come from another seed)
    # arithmetic and lookup: built-in tasks (problems generated from `seed`)
    num_digits: int = 2
    reverse_answer: bool = False  # write answers least-significant digit first (learned much faster)
    held_out: int = 500
    # gsm8k-style math: loaded with `datasets` (a hub id or a local path / data files)
    dataset: str = "openai/gsm8k"
    dataset_config: str | None = "main"
    train_split: str = "train"
    eval_split: str = "test"
    # gsm8k and reasoning_gym ask in the model's chat template when its tokenizer has one, and multi-turn tasks do
    # with environment.chat_template; these reach the template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The reward: "package.module:function" taking (completion_text, answer) -> float; None = the task's own.
    reward: str | None = None
    reward_timeout_s: float = 10.0
    # openenv: the Action field the model's text fills and the Observation field it reads (None: the type's one str
    # field beyond OpenEnv's own)
    action_field: str | None = None
    observation_field: str | None = None

    def __post_init__(self) -> None:
        if self.source == "forge" and self.name not in FORGE_TASKS:
            raise ValueError(f"name={self.name!r}: must be one of {', '.join(map(repr, FORGE_TASKS))} "
                             "(or a reasoning-gym dataset with source: reasoning_gym)")
        if self.options and self.source not in ("reasoning_gym", "openenv"):
            raise ValueError(f"options={self.options!r}: only reasoning_gym tasks take options (and openenv ones, as "
                             "their environment's constructor arguments)")
        if self.source != "openenv" and (self.action_field or self.observation_field):
            raise ValueError(f"action_field={self.action_field!r}, observation_field={self.observation_field!r}: "
                             "only openenv tasks take them")
        for name in ("size", "num_digits", "held_out"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.reward is not None and (self.source == "openenv" or (self.source, self.name) == ("forge", "lookup")):
            raise ValueError(f"reward={self.reward!r}: a {self.source}/{self.name} task is multi-turn; its environment "
                             "scores the episodes, so it takes no reward function")
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"reward={self.reward!r}: must be 'package.module:function'")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s={self.reward_timeout_s}: must be > 0")
        if self.source == "openenv":
            self.openenv_spec()  # importable, an OpenEnv environment, its text fields known: before anything starts

    def openenv_spec(self) -> Any:
        """The OpenEnv environment this task names, resolved and checked (forge.environments.openenv.OpenEnvSpec)."""
        from forge.environments.openenv import OpenEnvSpec

        return OpenEnvSpec.resolve(self.name, options=self.options, action_field=self.action_field,
                                   observation_field=self.observation_field)
