"""A multi-turn trajectory, token in / token out: the exact ids the model saw and produced, nothing re-tokenized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rl.types import Completion, Episode

# Why an episode ended: the environment said done, or a limit cut it (truncated), or the environment failed.
EndReason = Literal["done", "max_turns", "max_total_tokens", "environment_error", "running"]


@dataclass
class Trajectory:
    prompt_ids: list[int]  # the first prompt (the environment's reset observation; none when the reset failed)
    # Everything after the prompt, in order: model turns and the environment's observations between them.
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: the environment's
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per token (0 on the environment's)
    versions: list[int] = field(default_factory=list)  # policy version per token (-1 on the environment's)
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn in completion_ids
    actions: list[str] = field(default_factory=list)  # each model turn's text, as the environment got it
    reward: float = 0.0
    end: EndReason = "running"
    error: str | None = None  # the environment's failure, when end == "environment_error"
    # Kept sets of truncated sampling, per model turn (None: the turn sampled the full vocabulary).
    kept: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """The whole sequence so far: the next turn's prompt."""
        return self.prompt_ids + self.completion_ids

    @property
    def truncated(self) -> bool:
        return self.end in ("max_turns", "max_total_tokens")

    @property
    def failed(self) -> bool:
        """Its environment failed: the episode is not the model's doing, so it is neither scored nor trained."""
        return self.end == "environment_error"

    def add_model_turn(self, completion: Completion) -> None:
        start = len(self.completion_ids)
        self.completion_ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.policy_versions
        self.turns.append((start, len(self.completion_ids)))
        self.actions.append(completion.text)
        self.kept.append(completion.kept_token_ids)

    def add_observation(self, token_ids: list[int]) -> None:
        self.completion_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def to_episode(self, *, episode_id: int, group_id: int, reward: float, advantage: float = 0.0) -> Episode:
        """The episode the replay buffer stores (called like `Episode.from_completion`, with the reward given)."""
        return Episode(episode_id=episode_id, group_id=group_id, prompt_ids=list(self.prompt_ids),
                       completion_ids=list(self.completion_ids), behaviour_logprobs=list(self.logprobs),
                       policy_versions=list(self.versions), reward=reward, advantage=advantage,
                       kept_token_ids=self._kept_token_ids(), completion_mask=list(self.mask))

    def _kept_token_ids(self) -> torch.Tensor | None:
        """[len(completion_ids), K] int32: each model turn's kept rows in place, -1 (full vocabulary) elsewhere."""
        if all(k is None for k in self.kept):
            return None
        width = max(k.shape[1] for k in self.kept if k is not None)
        kept = torch.full((len(self.completion_ids), width), -1, dtype=torch.int32)
        for (start, end), rows in zip(self.turns, self.kept):
            if rows is not None:
                kept[start:end, : rows.shape[1]] = rows
        return kept
