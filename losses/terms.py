"""The pieces the policy losses share: masked reductions, importance ratios, KL estimators, metrics.

Conventions: `mask` is `batch.response_mask` ([B, T-1], non-zero on generated tokens). Log-differences
are zeroed off the mask *before* any `exp`, so whatever sits in prompt or padding positions can never
produce inf/NaN in the loss or its gradient.
"""

from __future__ import annotations

import math

import torch

from forge.loss_rules import KL_ESTIMATORS, check_hyperparams  # noqa: F401  (re-exported for the losses)
from forge.types import TrainBatch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return torch.where(mask > 0, values, 0).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked positions; 0 (not NaN) where the mask is empty."""
    return masked_sum(values, mask, dim) / (mask > 0).sum(dim).clamp(min=1)


def truncated_is_weight(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(pi_old / pi_behaviour, cap) per token, detached; 1 off the mask."""
    log_weight = torch.where(mask > 0, old_logprobs - behaviour_logprobs, 0).detach()
    return log_weight.exp().clamp(max=cap)


def importance_ratio(
    logprobs: torch.Tensor, batch: TrainBatch, *, old_logprobs: torch.Tensor | None, tis_cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log(pi_theta / pi_anchor) (0 off the mask) and the detached correction weight.

    Decoupled PPO (Hilton et al. 2021, arXiv:2110.00641) with truncated importance sampling:
      tis_cap=None: anchor = pi_behaviour (the generator's recorded log-probs), weight = 1.
      tis_cap=C:    anchor = pi_old (the trainer before this update),
                    weight = min(pi_old / pi_behaviour, C), the stale-sample correction.
    The clip then bounds how far this update moves from the anchor, and the weight corrects for the
    tokens having been sampled by an older (or numerically different) policy.
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
    if tis_cap is None:
        anchor, weight = batch.behaviour_logprobs, torch.ones_like(logprobs)
    else:
        old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
        anchor, weight = old_logprobs, truncated_is_weight(old_logprobs, batch.behaviour_logprobs, mask, tis_cap)
    log_ratio = torch.where(mask > 0, logprobs - anchor.detach(), 0)
    return log_ratio, weight


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
    }
    if kl is not None:
        metrics["kl"] = masked_mean(kl, mask)
    values = torch.stack([value.double() for value in metrics.values()]).tolist()
    return dict(zip(metrics, values))
