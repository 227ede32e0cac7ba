"""Which task a job trains on, as its config's `task` section (plain Python: checked before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FORGE_TASKS = ("arithmetic", "gsm8k", "lookup")


@dataclass
class TaskConfig:
    # "forge": a task of forge's own (`name`: arithmetic, gsm8k, or lookup: multi-turn, forge/tasks/lookup.py);
    # "reasoning_gym": any reasoning-gym dataset by its name, with `options` passed to it and its own scorer as the
    # reward.
    source: Literal["forge", "reasoning_gym"] = "forge"
    name: str = "arithmetic"
    options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym: the dataset's config fields
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
    # gsm8k and reasoning_gym ask in the model's chat template when its tokenizer has one; these reach the
    # template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The reward: "package.module:function" taking (completion_text, answer) -> float; None = the task's own.
    reward: str | None = None
    reward_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.source == "forge" and self.name not in FORGE_TASKS:
            raise ValueError(f"name={self.name!r}: must be one of {', '.join(map(repr, FORGE_TASKS))} "
                             "(or a reasoning-gym dataset with source: reasoning_gym)")
        if self.options and self.source != "reasoning_gym":
            raise ValueError(f"options={self.options!r}: only reasoning_gym tasks take options")
        for name in ("size", "num_digits", "held_out"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.reward is not None and (self.source, self.name) == ("forge", "lookup"):
            raise ValueError(f"reward={self.reward!r}: the lookup task is multi-turn; its environment scores the "
                             "episodes (forge/tasks/lookup.py), so it takes no reward function")
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"reward={self.reward!r}: must be 'package.module:function'")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s={self.reward_timeout_s}: must be > 0")
