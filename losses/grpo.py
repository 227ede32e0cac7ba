"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300)."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import (
    Band,
    check_hyperparams,
    clip_active,
    clipped_surrogate,
    importance_ratio,
    kl_estimate,
    loss_metrics,
    masked_mean,
)
from losses.types import LossOutput


def grpo(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """GRPO (arXiv:2402.03300) as a loss, the negated objective:

        L = -1/G sum_i 1/|o_i| sum_t [ w_t min(r_t A_i, clip(r_t, 1-eps, 1+eps) A_i) - beta KL_t ]

    r_t = pi_theta / pi_anchor (`losses.terms.importance_ratio`): without `tis_cap` the anchor is the
    behaviour policy the generator sampled from; with `tis_cap=C` it is pi_old, the trainer's own policy
    before this batch's update (decoupled PPO). w_t is the detached rollout correction
    (`losses.terms.correction_weight`): 1 when none is set; TIS with `tis_cap`, MIS/IcePop token masks with
    `token_mask_band`, geometric-mean sequence masks with `seq_mask_band`. A_i comes from
    `batch.advantages`. KL_t estimates KL(pi_theta || pi_ref) with `kl_estimator` ("k1", "k2", "k3");
    it is added only when `batch.ref_logprobs` is set and `kl_coef` (beta) > 0.
    """
    check_hyperparams("grpo", clip_eps=clip_eps, kl_coef=kl_coef, kl_estimator=kl_estimator, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()  # r_t
    advantages = batch.advantages.unsqueeze(-1)  # A_i, the same for every token of sequence i
    token_loss = -is_weight * clipped_surrogate(ratio, advantages, clip_eps, clip_eps)
    kl = None
    if batch.ref_logprobs is not None and kl_coef > 0:
        kl = kl_estimate(logprobs, batch.ref_logprobs, mask, kl_estimator)
        token_loss = token_loss + kl_coef * kl
    loss = masked_mean(token_loss, mask, dim=-1).mean()  # 1/|o_i| sum_t, then 1/G sum_i
    clipped = clip_active(ratio, advantages, clip_eps, clip_eps)
    return LossOutput(loss, loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight, kl=kl))
