"""What every policy loss returns, and the signature the trainer calls it with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the policy's log-probs
    metrics: dict[str, float]


# loss_fn(logprobs [B, T-1], batch: rl.types.TrainBatch, *, old_logprobs=None, **hyperparams) -> LossOutput
LossFn = Callable[..., LossOutput]
