"""Which task a job trains on, as its config's `task` section (plain Python: checked before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rl.tasks.environment import check_options, resolve_environment

FORGE_TASKS = ("arithmetic", "gsm8k", "lookup")
# Multi-turn sources whose environment gives rewards, not reference answers: nothing to fine-tune or warm start on.
ENVIRONMENT_SOURCES = ("openenv", "environment")


@dataclass
class TaskConfig:
    """What the job trains on, and how it is scored."""

    source: Literal["forge", "reasoning_gym", "openenv", "environment"] = "forge"
    """`forge`: a task of forge's own (`name`). `reasoning_gym`: any reasoning-gym dataset by its name, with
    `options` passed to it and its own scorer as the reward. `openenv`: an OpenEnv environment used unchanged
    (rl/tasks/openenv.py, docs/multiturn.md), multi-turn. `environment`: a class written to forge's Environment
    protocol (`async reset(problem)`, `async step(action) -> StepResult`; rl/tasks/environment.py,
    docs/environments.md), multi-turn. openenv and environment need `warm_start.enabled: false`."""
    name: str = "arithmetic"
    """forge: `arithmetic` (built in), `gsm8k` (via `datasets`, scored by math-verify) or `lookup` (the built-in
    multi-turn task, rl/tasks/lookup.py: its environment scores the episodes, so `reward` is refused);
    reasoning_gym: the dataset's name; openenv and environment: the class, `package.module:Class` (its module
    importable: PYTHONPATH; an openenv one is an `Environment` subclass, or the `EnvClient` subclass of a served
    one; an environment one may declare `stop_texts`, one-token texts that end a model turn)."""
    options: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym: the dataset's config fields; openenv and environment: the class's constructor's keyword
    arguments, checked against its signature when the config is read."""
    size: int = 10_000
    """reasoning_gym: training problems generated (held-out ones come from another seed, and any also in training
    is dropped)."""
    num_digits: int = 2
    """arithmetic and lookup: operand size (problems generated from `seed`)."""
    reverse_answer: bool = False
    """arithmetic: write answers least-significant digit first (learned much faster; tiny: true)."""
    held_out: int = 500
    """Held-out evaluation set size (environments: evaluation episodes use seeds [0, held_out))."""
    dataset: str = "openai/gsm8k"
    """gsm8k: loaded with `datasets`, a hub id or a local path / data files (a single data file is split into
    disjoint training and held-out rows)."""
    dataset_config: str | None = "main"
    """gsm8k: the dataset's config name."""
    train_split: str = "train"
    """gsm8k: the training split."""
    eval_split: str = "test"
    """gsm8k: the held-out split."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """gsm8k and reasoning_gym ask in the model's chat template when its tokenizer has one (stopping at its
    end-of-turn token), and multi-turn tasks do with `environment.chat_template`; these reach the template (Qwen3
    configs: `enable_thinking: false`)."""
    partial_credit: bool = True
    """reasoning_gym: reward the dataset's score as it is, partial credit included (false: 1 for a score of 1, else 0,
    so a run is rewarded only for what an exact-accuracy evaluation counts)."""
    reward: str | None = None
    """`package.module:function` taking (completion_text, answer) -> float; null: the task's exact-match reward. A
    reward that raises, hangs past `reward_timeout_s` or returns NaN scores 0, is counted in `reward/failures`, and
    its traceback is printed once per kind of failure; the run goes on."""
    reward_timeout_s: float = 10.0
    """Per reward call."""
    action_field: str | None = None
    """openenv: the Action field the model's text fills (null: the type's one str field beyond OpenEnv's own)."""
    observation_field: str | None = None
    """openenv: the Observation field the model reads (null: the type's one str field beyond OpenEnv's own)."""

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
        if not self.partial_credit and (self.source != "reasoning_gym" or self.reward is not None):
            raise ValueError(f"partial_credit=false: only a reasoning_gym task's own scorer gives partial credit (this "
                             f"task: source={self.source!r}, reward={self.reward!r}); remove it")
        if self.reward is not None and self.multi_turn:
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
            from rl.tasks.reasoning_gym import check_dataset

            check_dataset(self.name, self.options, size=self.size, prefix="")
        if self.source == "forge" and self.name in ("arithmetic", "lookup"):
            self._check_held_out()

    @property
    def multi_turn(self) -> bool:
        """Its episodes are played against an environment, which scores them (lookup, openenv, environment)."""
        return self.source in ENVIRONMENT_SOURCES or (self.source, self.name) == ("forge", "lookup")

    def _check_held_out(self) -> None:
        """At most half of a built-in task's problems are held out (so training problems remain to draw)."""
        from rl.tasks.arithmetic import ArithmeticTask
        from rl.tasks.lookup import LookupTask

        task = ArithmeticTask if self.name == "arithmetic" else LookupTask
        most = task.max_held_out(self.num_digits)
        if self.held_out > most:
            raise ValueError(f"held_out={self.held_out}: must be at most {most} for the {self.name} task with "
                             f"num_digits={self.num_digits} (half of its distinct problems)")

    def _check_reward(self) -> None:
        """`reward` imports and takes (completion_text, answer), as the rollout calls it: before anything starts."""
        import inspect

        from forge.config import load_callable

        fn = load_callable(self.reward, field="reward")
        try:
            inspect.signature(fn).bind("completion text", "answer")
        except TypeError as e:
            raise ValueError(f"reward={self.reward!r}: must take (completion_text, answer), as the rollout calls it "
                             f"({e})") from None
        except ValueError:  # a builtin without a signature: nothing to check against
            pass

    def openenv_spec(self) -> Any:
        """The OpenEnv environment this task names, resolved and checked (rl.environments.openenv.OpenEnvSpec)."""
        from rl.environments.openenv import OpenEnvSpec

        return OpenEnvSpec.resolve(self.name, options=self.options, action_field=self.action_field,
                                   observation_field=self.observation_field)
