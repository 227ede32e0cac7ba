"""The Tinker SDK's built-in losses, with Tinker's semantics: sums over tokens (not means), per-token advantages and
per-token weights, as its documentation writes them. The training service runs them for requests that come through
the Tinker protocol (apps/server/tinker/routes.py); forge's own losses (grpo, dapo, ...) stay what apps.grpo uses.

Every function has forge's loss signature (`losses.types`): `logprobs` [B, T-1] are the trainer's log-probs of the
datum's target tokens, and the batch carries Tinker's `loss_fn_inputs` as
    batch.response_mask       <- weights (cross_entropy) / 1 on every real position (the RL losses)
    batch.behaviour_logprobs  <- logprobs (the sampler's, for the importance ratio)
    batch.token_advantages    <- advantages (per token; 0 on the prompt)
Padding positions hold weight 0 and advantage 0, so they add nothing to any sum.
"""

from __future__ import annotations

import torch

from losses.types import LossOutput
from rl.types import TrainBatch

# Tinker's default clip thresholds on the ratio pi_theta / pi_sampler (loss_fn_config keys of the same names).
CLIP_LOW = 0.8
CLIP_HIGH = 1.2


def _advantages(batch: TrainBatch) -> torch.Tensor:
    if batch.token_advantages is None:
        raise ValueError("this loss needs loss_fn_inputs['advantages'] (one value per target token)")
    return batch.token_advantages


def _ratio(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """pi_theta / pi_sampler per token; the log-difference is zeroed off the real positions before exp."""
    real = batch.response_mask > 0
    return torch.exp(torch.where(real, logprobs - batch.behaviour_logprobs, 0.0))


def cross_entropy(logprobs: torch.Tensor, batch: TrainBatch, *, old_logprobs: torch.Tensor | None = None) -> LossOutput:
    """L = -sum_t w_t log p_theta(x_t)      (w: loss_fn_inputs['weights'])"""
    loss = -(batch.response_mask * logprobs).sum()
    return LossOutput(loss, {"loss:sum": loss.item()})


def importance_sampling(logprobs: torch.Tensor, batch: TrainBatch, *,
                        old_logprobs: torch.Tensor | None = None) -> LossOutput:
    """L = -sum_t r_t A_t,    r_t = p_theta(x_t) / q(x_t)      (q: the sampler's logprobs; A: advantages)"""
    ratio = _ratio(logprobs, batch)
    loss = -(ratio * _advantages(batch)).sum()
    return LossOutput(loss, {"loss:sum": loss.item()})


def ppo(logprobs: torch.Tensor, batch: TrainBatch, *, old_logprobs: torch.Tensor | None = None,
        clip_low_threshold: float = CLIP_LOW, clip_high_threshold: float = CLIP_HIGH) -> LossOutput:
    """L = -sum_t min(r_t A_t, clip(r_t, low, high) A_t)"""
    _check_thresholds(clip_low_threshold, clip_high_threshold)
    ratio = _ratio(logprobs, batch)
    advantages = _advantages(batch)
    objective = torch.minimum(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)
    loss = -objective.sum()
    return LossOutput(loss, {"loss:sum": loss.item(), **_clip_metrics(ratio, batch, clip_low_threshold,
                                                                      clip_high_threshold)})


def cispo(logprobs: torch.Tensor, batch: TrainBatch, *, old_logprobs: torch.Tensor | None = None,
          clip_low_threshold: float = CLIP_LOW, clip_high_threshold: float = CLIP_HIGH) -> LossOutput:
    """L = -sum_t sg(clip(r_t, low, high)) A_t log p_theta(x_t)      (sg: no gradient through the ratio)"""
    _check_thresholds(clip_low_threshold, clip_high_threshold)
    ratio = _ratio(logprobs, batch)
    weight = ratio.clamp(clip_low_threshold, clip_high_threshold).detach()
    loss = -(weight * _advantages(batch) * logprobs * (batch.response_mask > 0)).sum()
    return LossOutput(loss, {"loss:sum": loss.item(), **_clip_metrics(ratio, batch, clip_low_threshold,
                                                                      clip_high_threshold)})


def _check_thresholds(low: float, high: float) -> None:
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"clip_low_threshold={low}, clip_high_threshold={high}: need 0 <= low <= 1 <= high")


def _clip_metrics(ratio: torch.Tensor, batch: TrainBatch, low: float, high: float) -> dict[str, float]:
    real = batch.response_mask > 0
    clipped = ((ratio < low) | (ratio > high)) & real & (_advantages(batch) != 0)
    return {"clipped_tokens:sum": float(clipped.sum())}


# The loss names a Tinker client may send, and the functions that answer them (the others are listed in
# docs/serving.md as not served: dro, gspo, stable_reinforce, custom).
TINKER_LOSSES = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo,
                 "cispo": cispo}
# The loss_fn_config keys each takes.
TINKER_LOSS_CONFIG = {"cross_entropy": (), "importance_sampling": (),
                      "ppo": ("clip_low_threshold", "clip_high_threshold"),
                      "cispo": ("clip_low_threshold", "clip_high_threshold")}
