"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071)."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import Band, check_hyperparams, clip_active, clipped_surrogate, importance_ratio, loss_metrics, masked_mean
from losses.types import LossOutput


def gspo(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """GSPO (arXiv:2507.18071) as a loss, the negated objective:

        s_i = (pi_theta(o_i) / pi_anchor(o_i))^(1/|o_i|) = exp(1/|o_i| sum_t log r_t)
        L = -1/G sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)

    The ratio, and therefore the clip, is per sequence: the geometric mean of the token ratios. The
    paper's clip range is two orders of magnitude below PPO's because s_i is length-normalised. With a
    rollout correction, the sequence term is spread over its tokens and token t is weighted by w_t (the mean of
    w_t over the sequence multiplies the term); w_t = 1 without one, so L is exactly the equation above.
    A token mask removes a token's term but not its share of s_i; `seq_mask_band` is the sequence-level
    correction that matches GSPO's sequence-level ratio. r_t and w_t as in `losses.grpo.grpo`.
    """
    check_hyperparams("gspo", clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    seq_ratio = masked_mean(log_ratio, mask, dim=-1).exp().unsqueeze(-1)  # s_i, [B, 1]
    advantages = batch.advantages.unsqueeze(-1)
    token_loss = -is_weight * clipped_surrogate(seq_ratio, advantages, clip_low, clip_high)
    loss = masked_mean(token_loss, mask, dim=-1).mean()  # 1/G sum_i (one term per sequence)
    clipped = clip_active(seq_ratio, advantages, clip_low, clip_high)
    return LossOutput(loss, loss_metrics(mask, ratio=seq_ratio, clipped=clipped, is_weight=is_weight))
