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
    topk_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    reward_coef: float = 0.0,
    kl: str = "sampled",
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> LossOutput:
    """On-policy distillation as a loss, with pi_T the teacher (apps.grpo's teacher scores the student's samples where
    a reference model would). `kl` says which divergence is taken at each sampled prefix, and how:

    kl="sampled": the reverse KL's k1 estimate on the sampled token o_t (the teacher's `batch.ref_logprobs`),

        L   = -1/(sum_i |o_i|) sum_i sum_t w_t min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)
        A_t = -sg(log pi_theta(o_t) - log pi_T(o_t)) + lambda A_i

      On the student's own samples (o_t ~ pi_theta, r_t = 1) the first term's gradient is, at each position,
          E[(log pi_theta(o_t) - log pi_T(o_t)) grad log pi_theta(o_t)] = grad KL(pi_theta || pi_T)
      (the score function has mean 0), and its value is the k1 estimate of that KL. A_t is detached (sg): the
      teacher's log-ratio is a per-token advantage, so the clip, r_t and the rollout correction w_t are those of
      `losses.grpo.grpo`.

    kl="reverse" or "forward": the divergence itself over the vocabulary at each position (GKD's token-level
    divergence on the student's samples), from the teacher's top-K tokens and their log-probs (`batch.ref_topk_ids`,
    `batch.ref_topk_logprobs`) and the student's at the same ids (`topk_logprobs`, from the trainer), each with the
    rest of the vocabulary as one more bucket j:

        L     = 1/(sum_i |o_i|) sum_i sum_t w_t D_t  -  lambda/(sum_i |o_i|) sum_i sum_t w_t min(r_t A_i, clip(r_t) A_i)
        D_t   = KL(pi_theta || pi_T) = sum_j pi_theta(j) (log pi_theta(j) - log pi_T(j))    kl="reverse"
        D_t   = KL(pi_T || pi_theta) = sum_j pi_T(j) (log pi_T(j) - log pi_theta(j))        kl="forward"

      differentiated through the student's distribution at the position: no sampling noise there. With K at least the
      vocabulary the rest is empty and D_t is exact; with fewer, it is the divergence between the two distributions
      lumped into those K+1 buckets (a lower bound of it). The reverse KL's gradient on a token is proportional to the
      student's probability of it, so a student that gives the teacher's answer almost no mass gets almost no pull
      toward it; the forward KL pulls with the teacher's probability, pi_theta(j) - pi_T(j) on each logit.

    lambda = `reward_coef` mixes in the task reward's group advantage A_i (`batch.advantages`). Metric `reverse_kl`:
    mean over the tokens of log pi_theta(o_t) - log pi_T(o_t) (k1: unbiased; not k3, whose exp(log pi_T - log
    pi_theta) lets one token the student finds unlikely dominate a step), or of KL(pi_theta || pi_T) at each position
    with kl="reverse" or "forward"; `forward_kl`: the mean of KL(pi_T || pi_theta) with those two.
    """
    check_hyperparams("distill", clip_eps=clip_eps, reward_coef=reward_coef, kl=kl, tis_cap=tis_cap,
                      token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    mask = batch.response_mask
    log_ratio, is_weight = importance_ratio(logprobs, batch, old_logprobs=old_logprobs, tis_cap=tis_cap,
                                           token_mask_band=token_mask_band, seq_mask_band=seq_mask_band)
    ratio = log_ratio.exp()  # r_t
    reward_advantages = reward_coef * batch.advantages.unsqueeze(-1).expand_as(ratio)  # lambda A_i
    if kl == "sampled":
        if batch.ref_logprobs is None:
            raise ValueError("distill: batch.ref_logprobs is None; the loss needs the teacher's log-probs of the "
                             "sampled tokens (apps.grpo: set teacher.model)")
        student_over_teacher = torch.where(mask > 0, logprobs.detach() - batch.ref_logprobs, 0)  # sg(log pi - log pi_T)
        advantages = -student_over_teacher + reward_advantages  # A_t
        loss = masked_mean(-is_weight * clipped_surrogate(ratio, advantages, clip_eps, clip_eps), mask)
        metrics = {"reverse_kl": masked_mean(student_over_teacher, mask).item()}
    else:
        student, teacher = _topk_logprobs(topk_logprobs, batch, kl), batch.ref_topk_logprobs
        reverse = torch.where(mask > 0, position_kl(student, teacher), 0)  # KL(pi_theta || pi_T) at each position
        forward = torch.where(mask > 0, position_kl(teacher, student), 0)  # KL(pi_T || pi_theta)
        divergence = reverse if kl == "reverse" else forward  # D_t
        advantages = reward_advantages
        loss = (masked_mean(is_weight * divergence, mask)
                - masked_mean(is_weight * clipped_surrogate(ratio, advantages, clip_eps, clip_eps), mask))
        metrics = {"reverse_kl": masked_mean(reverse.detach(), mask).item(),
                   "forward_kl": masked_mean(forward.detach(), mask).item()}
    clipped = clip_active(ratio, advantages, clip_eps, clip_eps)
    return LossOutput(loss, {**loss_metrics(mask, ratio=ratio, clipped=clipped, is_weight=is_weight), **metrics})


def position_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_j p_j (log p_j - log q_j) over the last dimension: [..., K+1] log-probs of the same buckets
    (the teacher's top-K tokens, then the rest of the vocabulary) -> [...]. An empty bucket's log-prob is
    `torch.finfo(dtype).min`, not -inf (actors.logprobs.bucket_logprobs), so its term and gradient are 0, not NaN."""
    return (p.exp() * (p - q)).sum(-1)


def _topk_logprobs(topk_logprobs: torch.Tensor | None, batch: TrainBatch, kl: str) -> torch.Tensor:
    """The student's [B, T-1, K+1] bucket log-probs, checked against the teacher's."""
    if batch.ref_topk_logprobs is None:
        raise ValueError(f"distill: kl={kl!r} and batch.ref_topk_logprobs is None; the loss needs the teacher's top-k "
                         "log-probs at every position (apps.grpo: teacher.top_k)")
    if topk_logprobs is None:
        raise ValueError(f"distill: kl={kl!r} and topk_logprobs=None; the trainer passes the student's log-probs of "
                         "the teacher's top-k ids (batch.ref_topk_ids) when the batch carries them")
    if topk_logprobs.shape != batch.ref_topk_logprobs.shape:
        raise ValueError(f"distill: topk_logprobs has shape {tuple(topk_logprobs.shape)}; must match "
                         f"batch.ref_topk_logprobs {tuple(batch.ref_topk_logprobs.shape)} ([B, T-1, K+1])")
    return topk_logprobs
