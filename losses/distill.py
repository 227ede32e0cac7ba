"""On-policy distillation: the per-token reverse KL of the student to a teacher, on the student's own samples
(Agarwal et al. 2024, GKD, arXiv:2306.13649; Lu & Thinking Machines Lab 2025, "On-Policy Distillation")."""

from __future__ import annotations

import torch

from rl.types import TrainBatch
from losses.terms import (
    Band,
    check_hyperparams,
    clip_active,
    clipped_surrogate,
    importance_ratio,
    loss_metrics,
    masked_mean,
)
from losses.types import LossOutput


def distill(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    reward_coef: float = 0.0,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """On-policy distillation as a loss, with pi_T the teacher (`batch.ref_logprobs`: apps.grpo's teacher scores the
    episodes where a reference model would):

        L   = -1/(sum_i |o_i|) sum_i sum_t w_t min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)
        A_t = -sg(log pi_theta(o_t) - log pi_T(o_t)) + lambda A_i

    On the student's own samples (o_t ~ pi_theta, r_t = 1) the first term's gradient is, at each position,
        E[(log pi_theta(o_t) - log pi_T(o_t)) grad log pi_theta(o_t)] = grad KL(pi_theta || pi_T)
    (the score function has mean 0), and its value is the k1 estimate of that KL. A_t is detached (sg): the
    teacher's log-ratio is a per-token advantage, so the clip, r_t and the rollout correction w_t are those of
    `losses.grpo.grpo`. lambda = `reward_coef` mixes in the task reward's group advantage A_i (`batch.advantages`).
    Metric `reverse_kl`: the k1 estimate of KL(pi_theta || pi_T), mean(log pi_theta - log pi_T) over the tokens
    (unbiased; not k3: its exp(log pi_T - log pi_theta) lets one token the student finds unlikely dominate a step).
    """
    check_hyperparams("distill", clip_eps=clip_eps, reward_coef=reward_coef, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    if batch.ref_logprobs is None:
        raise ValueError("distill: batch.ref_logprobs is None; the loss needs the teacher's log-probs of the sampled "
                         "tokens (apps.grpo: set teacher.model)")
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()  # r_t
    student_over_teacher = torch.where(mask > 0, logprobs.detach() - batch.ref_logprobs, 0)  # sg(log pi - log pi_T)
    advantages = -student_over_teacher + reward_coef * batch.advantages.unsqueeze(-1)  # A_t
    token_loss = -is_weight * clipped_surrogate(ratio, advantages, clip_eps, clip_eps)
    loss = masked_mean(token_loss, mask)  # 1/(sum_i |o_i|) sum_i sum_t
    clipped = clip_active(ratio, advantages, clip_eps, clip_eps)
    return LossOutput(loss, {**loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight),
                             "reverse_kl": masked_mean(student_over_teacher, mask).item()})
