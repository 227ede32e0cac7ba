"""The warm start's settings and their checks, in plain Python: no torch (a job's config is checked before its
training stack is imported; `apps.warm_start.supervised` runs it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WarmStartConfig:
    """Supervised warm start on the task's answers, stopped at a greedy accuracy (multi-turn tasks train on correct
    episodes); cached in `model_cache`."""

    enabled: bool = True
    """Warm-start before GRPO (tasks without reference answers, openenv and environment ones, need false)."""
    target_accuracy: float = 0.2
    """Stop as soon as greedy accuracy on `eval_prompts` training problems reaches this (tiny: 0.15)."""
    lr: float = 1e-3
    """Learning rate (tiny: 3e-3)."""
    batch_size: int = 64
    """Examples per step."""
    max_steps: int = 3000
    """Steps at most."""
    eval_every: int = 20
    """Steps between accuracy checks (tiny: 5)."""
    eval_prompts: int = 200
    """Prompts per accuracy check."""
    check_every_step_from: float | None = None
    """Once a check reaches this accuracy, check after every step: accuracy can jump past the target between two
    checks (the multi-turn task: 26% -> 42% in 5 steps; multi-turn tiny: 0.26). null: every `eval_every` steps
    throughout."""

    def __post_init__(self) -> None:
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy={self.target_accuracy}: must be in (0, 1]")
        for name in ("batch_size", "max_steps", "eval_every", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.check_every_step_from is not None and not 0 < self.check_every_step_from <= self.target_accuracy:
            raise ValueError(f"check_every_step_from={self.check_every_step_from}: must be in (0, target_accuracy="
                             f"{self.target_accuracy}], or null")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
