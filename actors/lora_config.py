"""The trainer's LoRA settings (`trainer.lora`) and their checks, in plain Python: no torch, no peft.

Target modules are named as peft names them on the Hugging Face model (`q_proj`, `v_proj`, ...), so a config
reads the same as a peft one; `actors/lora.py` maps them onto the torchtitan model the trainer runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from actors.model_config import is_int, is_number, require_field

# The linear layers of each family's decoder blocks and the unembedding (lm_head), by their Hugging Face module names.
LORA_TARGETS = {"qwen3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")}


@dataclass
class LoRAConfig:
    """LoRA with peft's layers on the TorchTitan model, exported in peft's format."""

    rank: int = 16
    """The adapters' rank (at most the model's hidden size)."""
    alpha: float = 32.0
    """The update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """On the adapter's input, on the gradient pass only: every score (pi_old, the canary, `forward`) is without
    it."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Adapted modules, named as peft names them on the HF model (q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj, lm_head); checked against the model before anything starts."""

    def __post_init__(self) -> None:
        require_field(self, "rank", is_int(self.rank) and self.rank >= 1, "an int >= 1")
        require_field(self, "alpha", is_number(self.alpha) and self.alpha > 0, "a number > 0")
        require_field(self, "dropout", is_number(self.dropout) and 0 <= self.dropout < 1, "a number in [0, 1)")
        targets = self.target_modules
        require_field(self, "target_modules", isinstance(targets, (list, tuple)) and len(targets) > 0
                      and all(isinstance(t, str) for t in targets), "a non-empty list of module names")
        self.target_modules = list(dict.fromkeys(targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def check_lora_for_model(lora: LoRAConfig, family: str, hf_config: dict | None, *, field_prefix: str,
                         tensor_parallel_degree: int = 1) -> None:
    """`lora` fits the model: its family has LoRA, every target is one of its modules, and the rank is no larger
    than its hidden size. `hf_config` is the checkpoint's config.json (None: not local)."""
    if family not in LORA_TARGETS:
        raise ValueError(f"{field_prefix}: LoRA is built for family {', '.join(LORA_TARGETS)}; "
                         f"family={family!r} is not supported")
    allowed = LORA_TARGETS[family]
    unknown = [name for name in lora.target_modules if name not in allowed]
    if unknown:
        raise ValueError(f"{field_prefix}.target_modules={lora.target_modules!r}: {unknown} "
                         f"{'is not a module' if len(unknown) == 1 else 'are not modules'} of a {family} model; "
                         f"allowed: {list(allowed)}")
    if "lm_head" in lora.target_modules and hf_config is not None and hf_config.get("tie_word_embeddings"):
        raise ValueError(f"{field_prefix}.target_modules={lora.target_modules!r}: 'lm_head' is tied to the input "
                         "embedding in this model (tie_word_embeddings=true): an adapter on it would change both")
    if tensor_parallel_degree != 1:
        raise ValueError(f"{field_prefix}: LoRA trains with FSDP only; tensor_parallel_degree="
                         f"{tensor_parallel_degree} must be 1")
    if hf_config is not None and lora.rank > hf_config["hidden_size"]:
        raise ValueError(f"{field_prefix}.rank={lora.rank}: must be <= the model's hidden_size "
                         f"{hf_config['hidden_size']} (a low-rank update)")


def local_hf_config(model_path: str) -> dict | None:
    """The checkpoint's config.json when it is a local folder (a hub id is checked once downloaded)."""
    path = Path(model_path, "config.json")
    return json.loads(path.read_text()) if path.is_file() else None
