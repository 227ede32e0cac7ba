"""CISPO: Clipped IS-weight Policy Optimization (MiniMax 2025, MiniMax-M1, arXiv:2506.13585)."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import Band, check_hyperparams, importance_ratio, loss_metrics, masked_mean
from losses.types import LossOutput


def cispo(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """CISPO (arXiv:2506.13585) as a loss, the negated objective:

        L = -1/(sum_i |o_i|) sum_i sum_t w_t sg(clip(r_t, 1-eps_low, 1+eps_high)) A_i log pi_theta(o_t)

    The importance weight is clipped and detached (sg = stop-gradient) instead of the update, so every
    token keeps its REINFORCE gradient, only with a bounded weight. The default clip_low=1 is the
    paper's "no lower bound". Only the gradient is meaningful; the value is not a surrogate objective.
    r_t and w_t (the rollout correction) as in `losses.grpo.grpo`.
    """
    check_hyperparams("cispo", clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()
    clipped_weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()  # sg(clip(r_t, ...))
    advantages = batch.advantages.unsqueeze(-1)
    token_loss = -is_weight * clipped_weight * advantages * logprobs
    loss = masked_mean(token_loss, mask)  # 1/(sum_i |o_i|) sum_i sum_t
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)  # where the IS weight was truncated
    return LossOutput(loss, loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight))
