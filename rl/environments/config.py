"""A multi-turn job's `environment` section: episode limits and isolation (plain Python: no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EnvironmentConfig:
    """Multi-turn tasks: each episode's limits, where its environment runs, and chat mode (docs/multiturn.md)."""

    max_turns: int = 4
    """Model turns per episode."""
    max_total_tokens: int = 256
    """Prompt + model + environment tokens per episode."""
    step_timeout_s: float = 10.0
    """Per reset / step call of an environment; past it the episode is dropped (counted; with the rest of its group
    when fewer than 2 episodes are left)."""
    truncated_reward: float | None = 0.0
    """A truncated episode's reward; null: what its environment gave so far."""
    isolated: bool = False
    """Run the environments in their own actor process (rl.environments.actor): a crash or a blocking call there
    costs its episodes (counted in env/failures), never the job."""
    chat_template: bool = False
    """Chat mode (rl/environments/chat.py): the first prompt and each observation wrapped by the model's chat
    template, by token ids (`task.chat_template_kwargs` reach it); its end-of-turn token ends a turn, not the
    episode."""
    system_prompt: str | None = None
    """Chat mode: a system message before the first prompt (needs `chat_template`)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s}: must be > 0")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(f"system_prompt={self.system_prompt!r}: a system message needs chat_template=true "
                             "(plain-text episodes have no roles)")
