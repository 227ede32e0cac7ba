"""Which task a job trains on, as its config's `task` section (plain Python: checked before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from forge.tasks.environment import check_options, resolve_environment

FORGE_TASKS = ("arithmetic", "gsm8k", "lookup")


@dataclass
class TaskConfig:
    # "forge": a task of forge's own (`name`: arithmetic, gsm8k, or lookup: multi-turn, forge/tasks/lookup.py);
    # "reasoning_gym": any reasoning-gym dataset by its name, with `options` passed to it and its own scorer as the
    # reward; "openenv": an OpenEnv environment used unchanged (`name`: 'package.module:Class', `options`: its
    # constructor's keyword arguments; forge/tasks/openenv.py), multi-turn; "environment": a class written to forge's
    # own Environment protocol, named the same way (forge/tasks/environment.py, docs/environments.md), multi-turn.
    source: Literal["forge", "reasoning_gym", "openenv", "environment"] = "forge"
    name: str = "arithmetic"
    # reasoning_gym: the dataset's config fields; openenv and environment: the class's constructor's keyword arguments
    options: dict[str, Any] = field(default_factory=dict)
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
        if self.options and self.source not in ("reasoning_gym", "openenv", "environment"):
            raise ValueError(f"options={self.options!r}: only reasoning_gym tasks take options (and openenv and "
                             "environment ones, as their environment's constructor arguments)")
        if self.source != "openenv" and (self.action_field or self.observation_field):
            raise ValueError(f"action_field={self.action_field!r}, observation_field={self.observation_field!r}: "
                             "only openenv tasks take them")
        for name in ("size", "num_digits", "held_out"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        environment_class = self.source in ("openenv", "environment")
        if self.reward is not None and (environment_class or (self.source, self.name) == ("forge", "lookup")):
            raise ValueError(f"reward={self.reward!r}: a {self.source}/{self.name} task is multi-turn; its environment "
                             "scores the episodes, so it takes no reward function")
        if self.reward is not None:
            self._check_reward()
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s={self.reward_timeout_s}: must be > 0")
        if self.source == "openenv":  # importable, an OpenEnv environment, its text fields and options known
            check_options(self.openenv_spec().factory, self.options, field="options")
        if self.source == "environment":  # importable, forge's protocol, its options known
            resolve_environment(self.name, self.options, prefix="")
        if self.source == "reasoning_gym":  # the dataset exists and takes the options
            from forge.tasks.reasoning_gym import check_dataset

            check_dataset(self.name, self.options, size=self.size, prefix="")
        if self.source == "forge" and self.name in ("arithmetic", "lookup"):
            self._check_held_out()

    def _check_held_out(self) -> None:
        """At most half of a built-in task's problems are held out (so training problems remain to draw)."""
        from forge.tasks.arithmetic import ArithmeticTask
        from forge.tasks.lookup import LookupTask

        task = ArithmeticTask if self.name == "arithmetic" else LookupTask
        most = task.max_held_out(self.num_digits)
        if self.held_out > most:
            raise ValueError(f"held_out={self.held_out}: must be at most {most} for the {self.name} task with "
                             f"num_digits={self.num_digits} (half of its distinct problems)")

    def _check_reward(self) -> None:
        """`reward` imports and takes (completion_text, answer), as the rollout calls it: before anything starts."""
        import inspect

        from forge.tasks import load_callable

        fn = load_callable(self.reward, field="reward")
        try:
            inspect.signature(fn).bind("completion text", "answer")
        except TypeError as e:
            raise ValueError(f"reward={self.reward!r}: must take (completion_text, answer), as the rollout calls it "
                             f"({e})") from None
        except ValueError:  # a builtin without a signature: nothing to check against
            pass

    def openenv_spec(self) -> Any:
        """The OpenEnv environment this task names, resolved and checked (forge.environments.openenv.OpenEnvSpec)."""
        from forge.environments.openenv import OpenEnvSpec

        return OpenEnvSpec.resolve(self.name, options=self.options, action_field=self.action_field,
                                   observation_field=self.observation_field)
