"""The registered policy losses, declared once and without torch: each one's name, where its function is, and the
hyperparameters it takes.

A job's config is checked before its training stack is imported (apps/grpo/cli.py), so `TrainerConfig` checks a
registered loss's `loss_params` against this declaration; `losses.get_loss` imports the function from it.
tests/losses/test_get_loss.py checks each declaration against its function's signature.
"""

from __future__ import annotations

from dataclasses import dataclass

from losses.rules import PI_OLD_PARAMS

SUPPLIED_BY_TRAINER = frozenset({"logprobs", "batch", "old_logprobs"})  # every loss's non-hyperparameter arguments
# Given only to a loss that takes it, when the batch carries the teacher's top-k (`TrainBatch.ref_topk_ids`): the
# student's log-probs of those ids and of the rest of the vocabulary, [B, T-1, K+1] (losses/distill.py, kl="reverse"
# or "forward").
SUPPLIED_IF_TAKEN = frozenset({"topk_logprobs"})


@dataclass(frozen=True)
class RegisteredLoss:
    name: str  # what `trainer.loss` says
    function: str  # "package.module:function", imported only when the loss is used
    hyperparams: frozenset[str]  # its keyword arguments besides SUPPLIED_BY_TRAINER and SUPPLIED_IF_TAKEN


def _loss(name: str, *hyperparams: str) -> RegisteredLoss:
    """losses/<name>.py's function <name>; every registered loss also takes the rollout corrections (PI_OLD_PARAMS:
    losses/terms.py, docs/off_policy.md)."""
    return RegisteredLoss(name, f"losses.{name}:{name}", frozenset((*hyperparams, *PI_OLD_PARAMS)))


REGISTERED_LOSSES: dict[str, RegisteredLoss] = {loss.name: loss for loss in (
    _loss("grpo", "clip_eps", "kl_coef", "kl_estimator"),
    _loss("dapo", "clip_low", "clip_high"),
    _loss("gspo", "clip_low", "clip_high"),
    _loss("cispo", "clip_low", "clip_high"),
    _loss("dr_grpo", "clip_eps", "max_tokens"),
    _loss("distill", "clip_eps", "reward_coef", "kl"),
)}
LOSS_NAMES = tuple(REGISTERED_LOSSES)


def check_loss_name(name: str) -> None:
    """A loss given by name is registered or written 'package.module:function'."""
    if name not in REGISTERED_LOSSES and ":" not in name:
        raise ValueError(f"loss={name!r}: unknown; must be one of {', '.join(LOSS_NAMES)}, or 'package.module:function'")
