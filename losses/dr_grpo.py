"""Dr. GRPO: GRPO Done Right (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783)."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import Band, check_hyperparams, clip_active, clipped_surrogate, importance_ratio, loss_metrics, masked_sum
from losses.types import LossOutput


def dr_grpo(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    max_tokens: int | None = None,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """Dr. GRPO (arXiv:2503.20783) as a loss, the negated objective:

        L = -1/(G L_max) sum_i sum_t w_t min(r_t A_i, clip(r_t, 1-eps, 1+eps) A_i)

    GRPO without its two biases: no 1/|o_i| (which favours long wrong answers and short right ones)
    and no std normalisation of the advantage; the token sum is divided by a constant, L_max =
    `max_tokens` (the generation budget; default T-1). The advantage must be mean-centred only:
    `group_advantages(..., normalize_std=False)`. r_t and w_t (the rollout correction) as in `losses.grpo.grpo`.
    """
    check_hyperparams("dr_grpo", clip_eps=clip_eps, max_tokens=max_tokens, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()
    advantages = batch.advantages.unsqueeze(-1)
    token_loss = -is_weight * clipped_surrogate(ratio, advantages, clip_eps, clip_eps)
    max_tokens = mask.shape[-1] if max_tokens is None else max_tokens
    loss = masked_sum(token_loss, mask) / (mask.shape[0] * max_tokens)  # 1/(G L_max) sum_i sum_t
    clipped = clip_active(ratio, advantages, clip_eps, clip_eps)
    return LossOutput(loss, loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight))
