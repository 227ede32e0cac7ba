"""Policy-gradient losses for RL post-training: one paper's objective per function.

Every loss has the signature `loss_fn(logprobs, batch, *, old_logprobs=None, **hyperparams) -> LossOutput`
(see `losses.types`); `get_loss` resolves a name from a config to one.
"""

from __future__ import annotations

from forge.config import load_callable
from forge.loss_rules import check_loss_name
from losses.advantages import group_advantages, zero_variance_groups
from losses.cispo import cispo
from losses.dapo import dapo
from losses.dr_grpo import dr_grpo
from losses.grpo import grpo
from losses.gspo import gspo
from losses.types import LossFn, LossOutput

# forge.loss_rules.LOSS_NAMES names these for the config checks (tests/losses/test_get_loss.py keeps them equal).
LOSSES: dict[str, LossFn] = {"grpo": grpo, "dapo": dapo, "gspo": gspo, "cispo": cispo, "dr_grpo": dr_grpo}


def get_loss(name: str | LossFn) -> LossFn:
    """A registered name ("grpo", ...), a callable (returned as is), or "package.module:function"."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"loss={name!r}: must be a loss name, a callable or 'package.module:function'")
    check_loss_name(name)
    if name in LOSSES:
        return LOSSES[name]
    return load_callable(name, field="loss")


__all__ = ["LOSSES", "LossFn", "LossOutput", "get_loss", "group_advantages", "zero_variance_groups",
           "grpo", "dapo", "gspo", "cispo", "dr_grpo"]
