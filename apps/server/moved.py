"""The apps.server modules renamed or merged so that each name says its one job (December 2026): each old module is
left as a shim whose names still import from it, with a DeprecationWarning naming the new place, for one release
(docs/changelog.md, "apps.server module names"; tests/apps/test_moved_names.py checks each)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

# old module -> (its new module, the names that moved: None for all of them)
MOVED: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "apps.server.session_registry": ("apps.server.sessions", None),
    "apps.server.checkpoint_store": ("apps.server.checkpoints", None),
    "apps.server.checkpointing": ("apps.server.checkpoints", None),
    "apps.server.training_actor": ("apps.server.trainer", None),
    "apps.server.adapter_sampler": ("apps.server.lora_trainer", None),
    "apps.server.tinker_routes": ("apps.server.tinker.routes", None),
    "apps.server.tinker_service": ("apps.server.tinker.service", None),
    "apps.server.tinker_wire": ("apps.server.tinker.wire", None),
    "apps.server.futures": ("apps.server.tinker.futures", None),
    "apps.server.batches": ("apps.server.tinker.batches", ("tinker_batch",)),
}


def moved_from(old: str) -> Callable[[str], Any]:
    """Module `old`'s `__getattr__`: a name that moved is its new module's, with a DeprecationWarning."""
    new, names = MOVED[old]

    def __getattr__(name: str) -> Any:
        if not name.startswith("_") and (names is None or name in names):
            module = importlib.import_module(new)
            if hasattr(module, name):
                warnings.warn(f"{old}.{name} is deprecated: use {new}.{name}", DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
