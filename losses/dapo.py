"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv:2503.14476)."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import Band, check_hyperparams, clip_active, clipped_surrogate, importance_ratio, loss_metrics, masked_mean
from losses.types import LossOutput


def dapo(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """DAPO (arXiv:2503.14476) as a loss, the negated objective:

        L = -1/(sum_i |o_i|) sum_i sum_t w_t min(r_t A_i, clip(r_t, 1-eps_low, 1+eps_high) A_i)

    Clip-higher (eps_high > eps_low) leaves room for low-probability tokens to grow; the token-level
    mean weighs every token equally, so long sequences are not down-weighted. No KL term. Dynamic
    sampling (dropping groups whose rewards are all equal) happens before the loss, where groups are chosen
    (apps.grpo's `rollout.drop_zero_variance_groups`). r_t and w_t (the rollout correction) as in `losses.grpo.grpo`.
    """
    check_hyperparams("dapo", clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()
    advantages = batch.advantages.unsqueeze(-1)
    token_loss = -is_weight * clipped_surrogate(ratio, advantages, clip_low, clip_high)
    loss = masked_mean(token_loss, mask)  # 1/(sum_i |o_i|) sum_i sum_t
    clipped = clip_active(ratio, advantages, clip_low, clip_high)
    return LossOutput(loss, loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight))
