"""A LoRA session's adapter: the one a create_session request asks for (checked against the served model and
the server's trainer), and whether a checkpoint's adapter fits a session."""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from actors.lora_config import LORA_TARGETS, LoRAConfig, check_lora_for_model, local_hf_config
from apps.server.config import ServerConfig
from apps.http.errors import field_error
from apps.server.schemas import CheckpointInfo, CreateSessionRequest, LoRASpec


def session_lora(request: CreateSessionRequest, checkpoint: CheckpointInfo | None, cfg: ServerConfig,
                 model_path: str) -> LoRAConfig | None:
    """The new session's adapter: the request's `lora`, or a LoRA checkpoint's own; None for a full-model session.
    Checked against the model (a 422 naming the field: lora.rank, lora.target_modules, ...)."""
    if request.lora is None:
        lora = None if checkpoint is None or checkpoint.lora is None else LoRAConfig(**checkpoint.lora)
    elif checkpoint is not None and checkpoint.lora is None:
        raise field_error(["from_checkpoint"], checkpoint.checkpoint_id,
                          "is a full-model checkpoint; a LoRA session starts from a LoRA session's save_state")
    else:
        lora = lora_config(request.lora, cfg.trainer.family, model_path)
        if checkpoint is not None and not same_adapter(asdict(lora), checkpoint.lora):
            raise field_error(["lora"], request.lora.model_dump(), f"checkpoint {checkpoint.checkpoint_id!r} holds "
                              f"an adapter {adapter_summary(checkpoint.lora)}; omit lora to take the checkpoint's")
    if lora is not None and cfg.trainer.activation_checkpoint != "none":
        # actors.lora.init_adapters matches parameters by name, which a checkpointed block's wrapper changes: an
        # adapter added to the built model would keep peft's own draw, not its seed's.
        raise field_error(["lora"], request.lora and request.lora.model_dump(), "LoRA sessions need the server's "
                          f"trainer.activation_checkpoint='none' (it is {cfg.trainer.activation_checkpoint!r})")
    return lora


def lora_config(spec: LoRASpec, family: str, model_path: str) -> LoRAConfig:
    """The adapter `spec` asks for (default targets: every linear layer of the blocks), checked against the model."""
    targets = spec.target_modules or [m for m in LORA_TARGETS.get(family, ()) if m != "lm_head"]
    try:
        lora = LoRAConfig(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=targets)
        check_lora_for_model(lora, family, local_hf_config(model_path), field_prefix="lora")
    except ValueError as error:
        named = re.match(r"(?:lora|LoRAConfig)\.(\w+)=", str(error))  # the field the check names
        field = named[1] if named else None
        value = getattr(spec, field, None) if field else spec.model_dump()
        raise field_error(["lora", field] if field else ["lora"], value, str(error)) from None
    return lora


def same_adapter(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two sessions' adapters have the same shape and scale (dropout aside): a checkpoint of one loads
    into the other."""
    if a is None or b is None:
        return a is None and b is None
    return (a["rank"], a["alpha"], sorted(a["target_modules"])) == (b["rank"], b["alpha"], sorted(b["target_modules"]))


def adapter_summary(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "full-model weights"
    return f"a LoRA adapter (rank {lora['rank']}, alpha {lora['alpha']}, target_modules {lora['target_modules']})"
