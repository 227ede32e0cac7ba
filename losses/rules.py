"""The rules for the policy losses' hyperparameters, in plain Python: no torch.

A job's config is checked before its training stack is imported (apps/grpo/cli.py), so `TrainerConfig` checks
`loss_params` against these rules; which hyperparameters each registered loss takes is declared in
losses/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable

KL_ESTIMATORS = ("k1", "k2", "k3")
# How losses.distill takes the KL at each position: the reverse KL's k1 on the sampled token, or the reverse or forward
# KL over the teacher's top-k and the rest of the vocabulary.
DISTILL_KLS = ("sampled", "reverse", "forward")
VOCABULARY_KLS = ("reverse", "forward")  # those that need the teacher's top-k at every position (teacher.top_k)
# The rollout corrections (losses/terms.py): any of these set makes the loss need pi_old, the trainer's own log-probs
# before the batch's first optimizer step, which the trainer then computes.
PI_OLD_PARAMS = ("tis_cap", "token_mask_band", "seq_mask_band")
# The ratio band the mismatch metrics count tokens outside of when no token_mask_band is set: IcePop's
# [alpha, beta] = [0.5, 5] (Ring-1T report, arXiv:2510.18855).
MONITOR_BAND = (0.5, 5.0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


HYPERPARAM_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "clip_eps": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "clip_low": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "clip_high": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "kl_coef": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "kl_estimator": (lambda v: v in KL_ESTIMATORS, f"one of {', '.join(KL_ESTIMATORS)}"),
    "kl": (lambda v: v in DISTILL_KLS, f"one of {', '.join(DISTILL_KLS)}"),
    "reward_coef": (lambda v: _is_number(v) and v >= 0, "a number >= 0 (0: the teacher's KL alone)"),
    "tis_cap": (lambda v: v is None or (_is_number(v) and v > 0), "None (off) or a number > 0"),
    "max_tokens": (lambda v: v is None or (isinstance(v, int) and v >= 1), "None (use T-1) or an int >= 1"),
    "token_mask_band": (lambda v: v is None or _is_band(v), "None (off) or [low, high] with 0 <= low < high"),
    "seq_mask_band": (lambda v: v is None or _is_band(v), "None (off) or [low, high] with 0 <= low < high"),
}


def _is_band(value: object) -> bool:
    """[low, high] of the ratio pi_old / pi_behaviour: 0 <= low < high (high may be inf: no upper bound)."""
    return (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value)
            and 0 <= value[0] < value[1])


def uses_old_logprobs(loss_params: dict[str, object]) -> bool:
    """Whether a loss with these hyperparameters needs pi_old (a rollout correction is on)."""
    return any(loss_params.get(name) is not None for name in PI_OLD_PARAMS)


def check_hyperparams(loss: str, **values: object) -> None:
    """Raise a ValueError naming the loss, the hyperparameter, its value and what is allowed."""
    for name, value in values.items():
        is_valid, allowed = HYPERPARAM_RULES[name]
        if not is_valid(value):
            raise ValueError(f"{loss}: {name}={value!r}: must be {allowed}")


def check_advantage_normalization(loss: object, normalize_std: bool, *, loss_field: str, normalize_field: str) -> None:
    """Dr. GRPO (arXiv:2503.20783) is GRPO without the std normalization of the advantage: refuse the two together."""
    if loss == "dr_grpo" and normalize_std:
        raise ValueError(f"{loss_field}='dr_grpo' with {normalize_field}=True: Dr. GRPO's advantage is mean-centred "
                         f"only (the paper removes the division by the group's std); set {normalize_field}=false")
