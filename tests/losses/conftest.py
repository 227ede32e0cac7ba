"""A small hand-checkable batch shared by the loss tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rl.types import TrainBatch

L = math.log


@dataclass
class LossCase:
    """3 sequences x 5 target positions. Row 0 starts with two prompt positions, row 1 ends with
    padding; every other position is a response token (mask 1). The ratios pi_theta / pi_behaviour on the
    response tokens are, per row: [1.5, 0.5, 1.1] (A=+1.5), [0.5, 1.5, 0.9] (A=-0.8) and
    [1.3, 0.75, 1.25, 0.85, 1.0] (A=+0.4): both sides of each clip range, for both signs of advantage.
    `old` is the trainer's pre-update log-prob, with pi_old / pi_behaviour between 0.5 and 3."""

    mask: list[list[int]]
    behaviour: list[list[float]]
    logprobs: list[list[float]]
    old: list[list[float]]
    ref: list[list[float]]
    advantages: list[float]

    def tokens(self, row: int) -> list[int]:
        return [t for t, on in enumerate(self.mask[row]) if on]

    def num_tokens(self) -> int:
        return sum(len(self.tokens(row)) for row in range(len(self.mask)))

    def anchor_and_weight(self, row: int, t: int, tis_cap: float | None) -> tuple[float, float]:
        """By hand: the log-prob the ratio is taken against, and the truncated IS weight."""
        if tis_cap is None:
            return self.behaviour[row][t], 1.0
        return self.old[row][t], min(math.exp(self.old[row][t] - self.behaviour[row][t]), tis_cap)

    def batch(self, *, with_ref: bool = True, dtype: torch.dtype = torch.float64) -> TrainBatch:
        mask = torch.tensor(self.mask, dtype=dtype)
        return TrainBatch(
            input_ids=torch.zeros(len(self.mask), len(self.mask[0]) + 1, dtype=torch.long),
            response_mask=mask,
            behaviour_logprobs=torch.tensor(self.behaviour, dtype=dtype),
            policy_versions=torch.where(mask > 0, 0, -1),
            advantages=torch.tensor(self.advantages, dtype=dtype),
            rewards=torch.tensor(self.advantages, dtype=dtype),
            ref_logprobs=torch.tensor(self.ref, dtype=dtype) if with_ref else None,
        )

    def logprobs_leaf(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.tensor(self.logprobs, dtype=dtype, requires_grad=True)

    def old_tensor(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.tensor(self.old, dtype=dtype)


@pytest.fixture
def case() -> LossCase:
    behaviour = [
        [0.0, 0.0, -1.2, -0.4, -2.0],
        [0.0, -0.3, -1.6, -0.8, 0.0],
        [-0.5, -1.5, -0.6, -2.5, -0.9],
    ]
    log_ratio = [
        [0.0, 0.0, L(1.5), L(0.5), L(1.1)],
        [0.0, L(0.5), L(1.5), L(0.9), 0.0],
        [L(1.3), L(0.75), L(1.25), L(0.85), 0.0],
    ]
    old_over_behaviour = [
        [1.0, 1.0, 2.0, 0.6, 1.0],
        [1.0, 1.2, 3.0, 0.8, 1.0],
        [1.1, 0.5, 2.5, 1.0, 0.9],
    ]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Off the response the model still has log-probs (prompt/padding targets); the generator has none.
    off = -3.0
    return LossCase(
        mask=mask,
        behaviour=behaviour,
        logprobs=[[b + d if on else off for b, d, on in zip(*rows)] for rows in zip(behaviour, log_ratio, mask)],
        old=[[b + L(q) if on else off for b, q, on in zip(*rows)] for rows in zip(behaviour, old_over_behaviour, mask)],
        ref=[[-1.0, -0.9, -1.7, -0.2, -1.8], [-2.0, -0.6, -1.1, -1.0, -2.0], [-0.4, -1.9, -0.3, -2.2, -1.3]],
        advantages=[1.5, -0.8, 0.4],
    )
