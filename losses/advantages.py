"""Group-relative advantages: each completion scored against the others sampled for the same prompt."""

from __future__ import annotations

import torch


def _group_index(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Check the inputs; return each element's group as 0..num_groups-1, and num_groups."""
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards: shape {tuple(rewards.shape)}, dtype {rewards.dtype}; must be a 1-D float tensor")
    if group_ids.shape != rewards.shape or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids: shape {tuple(group_ids.shape)}, dtype {group_ids.dtype}; must be an "
                         f"integer tensor of the rewards' shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards: non-finite values at positions {bad}; every reward must be finite")
    unique_ids, group = torch.unique(group_ids, return_inverse=True)
    return group, unique_ids.numel()


def _zero_variance(rewards: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per element: every reward in its group is identical (checked exactly, not up to rounding)."""
    empty = rewards.new_zeros(num_groups)
    highest = empty.scatter_reduce(0, group, rewards, "amax", include_self=False)
    lowest = empty.scatter_reduce(0, group, rewards, "amin", include_self=False)
    return (highest == lowest)[group]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's outcome advantage (arXiv:2402.03300), per element i of group g:

        A_i = (R_i - mean_g R) / (std_g R + eps)     normalize_std=True (GRPO, DAPO, GSPO, CISPO)
        A_i =  R_i - mean_g R                        normalize_std=False (Dr. GRPO, arXiv:2503.20783)

    std is Bessel-corrected (as `torch.std`); a group of one has advantage 0. Returns
    (advantages, zero_variance): zero_variance[i] is True when all rewards in i's group are equal; those
    advantages are exactly 0 and the group carries no learning signal.
    """
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"group_advantages: eps={eps!r}: must be a number >= 0")
    group, num_groups = _group_index(rewards, group_ids)
    count = torch.bincount(group, minlength=num_groups).to(rewards.dtype)
    mean = rewards.new_zeros(num_groups).index_add(0, group, rewards) / count
    centred = rewards - mean[group]
    zero_variance = _zero_variance(rewards, group, num_groups)
    if normalize_std:
        variance = rewards.new_zeros(num_groups).index_add(0, group, centred**2) / (count - 1).clamp(min=1)
        centred = centred / (variance.sqrt()[group] + eps)
    # Rounding in the mean can leave ~1e-17 in an all-equal group; with eps=1e-6 that would become ~1e-11.
    return torch.where(zero_variance, 0, centred), zero_variance

