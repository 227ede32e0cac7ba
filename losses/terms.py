"""The pieces the policy losses share: masked reductions, importance ratios, KL estimators, metrics.

Conventions: `mask` is `batch.response_mask` ([B, T-1], non-zero on generated tokens). Log-differences
are zeroed off the mask *before* any `exp`, so whatever sits in prompt or padding positions can never
produce inf/NaN in the loss or its gradient.
"""

from __future__ import annotations

import math

import torch

from losses.rules import KL_ESTIMATORS, check_hyperparams  # noqa: F401  (re-exported for the losses)
from rl.types import TrainBatch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return torch.where(mask > 0, values, 0).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked positions; 0 (not NaN) where the mask is empty."""
    return masked_sum(values, mask, dim) / (mask > 0).sum(dim).clamp(min=1)


Band = tuple[float, float] | list[float] | None  # [low, high] of a ratio, or None: no bound


def in_band(values: torch.Tensor, band: Band) -> torch.Tensor:
    """low <= values <= high; everything when band is None."""
    if band is None:
        return torch.ones_like(values, dtype=torch.bool)
    return (values >= band[0]) & (values <= band[1])


def correction_weight(
    old_logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    tis_cap: float | None,
    token_mask_band: Band,
    seq_mask_band: Band,
) -> torch.Tensor:
    """The detached per-token weight w_t that corrects for tokens sampled by pi_behaviour (the generator, possibly
    some versions old or numerically different) instead of pi_old (the trainer before this batch's update).

    With rho_t = pi_old(o_t) / pi_behaviour(o_t) and g_i = exp(1/|o_i| sum_t log rho_t), its geometric mean:

        w_t = c_t * 1[low_tok <= rho_t <= high_tok] * 1[low_seq <= g_i <= high_seq]
        c_t = min(rho_t, C) with tis_cap=C, else 1

    Each published correction is a choice of these fields:
      TIS, truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
        Training"): w_t = min(rho_t, C)                          tis_cap=C
      MIS, masked IS (the same authors' follow-up; verl's token-level rejection): w_t = rho_t 1[rho_t <= C]
                                                                 tis_cap=C, token_mask_band=[0, C]
      IcePop (Ring-1T, arXiv:2510.18855, "Small Leak Can Sink a Great Ship"): w_t = M(rho_t; alpha, beta),
        M(k) = k on [alpha, beta], 0 outside                     tis_cap=beta, token_mask_band=[alpha, beta]
      Geometric-mean sequence masking (verl's "geometric" rejection): sequence i is dropped when g_i leaves
        the band, a length-independent test of how off-policy the whole sequence is   seq_mask_band=[low, high]
    A masked token keeps its place in the loss's normaliser (as in IcePop's equation): it only contributes 0.
    Off the response w_t is 1 (ignored by the losses).
    """
    mask = batch.response_mask
    log_rho = torch.where(mask > 0, old_logprobs - batch.behaviour_logprobs, 0).detach()
    rho = log_rho.exp()
    weight = torch.ones_like(rho) if tis_cap is None else rho.clamp(max=tis_cap)
    keep = in_band(rho, token_mask_band)
    if seq_mask_band is not None:
        geometric_mean = masked_mean(log_rho, mask, dim=-1).exp()  # g_i
        keep = keep & in_band(geometric_mean, seq_mask_band).unsqueeze(-1)
    return torch.where(keep | (mask == 0), weight, 0)


def importance_ratio(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None,
    tis_cap: float | None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log(pi_theta / pi_anchor) (0 off the mask) and the detached correction weight w_t.

    Decoupled PPO (Hilton et al. 2021, arXiv:2110.00641):
      tis_cap=None: anchor = pi_behaviour (the generator's recorded log-probs).
      tis_cap=C:    anchor = pi_old (the trainer before this batch's first optimizer step).
    The clip then bounds how far this update moves from the anchor, and w_t (`correction_weight`) corrects for
    the tokens having been sampled by an older (or numerically different) policy. Any correction needs
    `old_logprobs` (pi_old); without them this raises rather than guess (pi_theta would make r_t = 1 and switch
    the clip off).
    """
    mask = batch.response_mask
    for name, tensor in (("logprobs", logprobs), ("batch.behaviour_logprobs", batch.behaviour_logprobs),
                         ("old_logprobs", old_logprobs), ("batch.ref_logprobs", batch.ref_logprobs)):
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; must match batch.response_mask "
                             f"{tuple(mask.shape)} ([B, T-1])")
    if batch.advantages.shape != mask.shape[:1]:
        raise ValueError(f"batch.advantages has shape {tuple(batch.advantages.shape)}; must be "
                         f"({mask.shape[0]},), one per sequence")
    corrections = {"tis_cap": tis_cap, "token_mask_band": token_mask_band, "seq_mask_band": seq_mask_band}
    if not any(value is not None for value in corrections.values()):
        return torch.where(mask > 0, logprobs - batch.behaviour_logprobs.detach(), 0), torch.ones_like(logprobs)
    if old_logprobs is None:
        on = {name: value for name, value in corrections.items() if value is not None}
        raise ValueError(f"old_logprobs=None with {on}: the correction needs pi_old, the trainer's log-probs before "
                         "the batch's first optimizer step (TitanTrainer.train_step passes them)")
    weight = correction_weight(old_logprobs, batch, **corrections)
    anchor = batch.behaviour_logprobs if tis_cap is None else old_logprobs
    return torch.where(mask > 0, logprobs - anchor.detach(), 0), weight


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """PPO's min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) (Schulman et al. 2017, arXiv:1707.06347)."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)


def clip_active(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Where the clipped term wins the min, so the token contributes no gradient."""
    return ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token sample estimate of KL(pi_theta || pi_ref); 0 off the mask.

    Schulman, "Approximating KL Divergence" (2020). With log_r = log pi_ref - log pi_theta:
      k1 = -log_r (unbiased, high variance, can be negative), k2 = log_r^2 / 2 (biased, low variance),
      k3 = exp(log_r) - 1 - log_r (unbiased, >= 0; the GRPO paper's choice).
    """
    log_r = torch.where(mask > 0, ref_logprobs - logprobs, 0)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return log_r.exp() - 1 - log_r
    raise ValueError(f"kl_estimator={estimator!r}: must be one of {', '.join(KL_ESTIMATORS)}")


@torch.no_grad()
def loss_metrics(
    mask: torch.Tensor,
    *,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    is_weight: torch.Tensor,
    kl: torch.Tensor | None = None,
) -> dict[str, float]:
    """Token-level statistics over the response tokens, fetched with one device sync."""
    on = mask > 0
    metrics = {
        "clip_fraction": masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_min": torch.where(on, ratio, math.inf).amin(),
        "ratio_max": torch.where(on, ratio, -math.inf).amax(),
        "is_weight_mean": masked_mean(is_weight, mask),
        "is_weight_max": torch.where(on, is_weight, -math.inf).amax(),
        "masked_fraction": masked_mean((is_weight == 0).to(ratio.dtype), mask),  # tokens a correction dropped
    }
    if kl is not None:
        metrics["kl"] = masked_mean(kl, mask)
    values = torch.stack([value.double() for value in metrics.values()]).tolist()
    return dict(zip(metrics, values))
