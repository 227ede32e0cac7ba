"""Policy-gradient losses for RL post-training: one paper's objective per function.

Every loss has the signature `loss_fn(logprobs, batch, *, old_logprobs=None, **hyperparams) -> LossOutput`
(see `losses.types`); `get_loss` resolves a name from a config to one. The registered losses are declared in
`losses.registry`. Importing this package imports no torch (the config checks import `losses.registry`
before the training stack): the loss functions are imported from their modules (`losses.grpo:grpo`, ...) when
used, and the names below that need torch load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from forge.config import load_callable
from losses.registry import REGISTERED_LOSSES, check_loss_name

if TYPE_CHECKING:
    from losses.types import LossFn

# name -> the module that defines it; loaded on first access (PEP 562). The loss functions themselves are not
# among them: `losses.grpo` is the module once it has been imported, so a package attribute `grpo` could not stay
# the function.
_LAZY = {"LossFn": "losses.types", "LossOutput": "losses.types", "group_advantages": "losses.advantages"}


def get_loss(name: str | LossFn) -> LossFn:
    """A registered name ("grpo", ...), a callable (returned as is), or "package.module:function"."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"loss={name!r}: must be a loss name, a callable or 'package.module:function'")
    check_loss_name(name)
    reference = REGISTERED_LOSSES[name].function if name in REGISTERED_LOSSES else name
    return load_callable(reference, field="loss")


def __getattr__(name: str) -> Any:
    if name == "LOSSES":  # every registered loss's function, by name
        value: Any = {registered: get_loss(registered) for registered in REGISTERED_LOSSES}
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["LOSSES", "LossFn", "LossOutput", "get_loss", "group_advantages"]
