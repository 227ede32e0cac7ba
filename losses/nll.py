"""Supervised fine-tuning's loss: the negative log-likelihood of the demonstrated tokens."""

from __future__ import annotations

import torch

from losses.terms import masked_mean
from losses.types import LossOutput
from rl.types import TrainBatch


def nll(logprobs: torch.Tensor, batch: TrainBatch, *, old_logprobs: torch.Tensor | None = None) -> LossOutput:
    """Token-mean negative log-likelihood over the response mask, the whole batch's tokens at once:

        L = -1/N sum_{i,t} m_it log pi_theta(x_i,t+1 | x_i,<=t),    N = sum_{i,t} m_it

    `batch.response_mask` marks the tokens learned (a completion's, an assistant's); prompt and padding positions
    carry no weight and no gradient, whatever they hold. Every token weighs the same, so a long demonstration counts
    for its length (a sequence mean would not). `old_logprobs` is part of every loss's signature and unused: there
    is no behaviour policy to correct for."""
    mask = batch.response_mask
    loss = -masked_mean(logprobs, mask)
    return LossOutput(loss, {"tokens": float((mask > 0).sum())})
