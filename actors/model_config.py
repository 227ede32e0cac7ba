"""Where a model's weights come from and how it runs: the config fields the trainer and the reference model share.

Every check raises a ValueError naming the config class, the field, its value and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("qwen3", "llama3")
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # 'org/name': a model that is no local folder


def is_hf_checkpoint(path: object) -> bool:
    """A local folder with config.json, or (where no such path exists here) a hub id 'org/name'."""
    if not isinstance(path, str) or not path:
        return False
    return Path(path, "config.json").is_file() if Path(path).exists() else bool(HUB_ID.match(path))


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_field(config: object, name: str, ok: bool, allowed: str) -> None:
    """Raise a ValueError naming the config class, the field, its value and what is allowed."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: must be {allowed}")


@dataclass
class ModelConfig:
    """A model the trainer or the reference model builds with TorchTitan."""

    model_path: str
    """HF checkpoint folder or hub id: architecture, tokenizer and (by default) weights (apps: `${model}`)."""
    family: str = "qwen3"
    """TorchTitan model family of that checkpoint: qwen3 or llama3."""
    init_checkpoint: str | None = None
    """A TorchTitan/DCP checkpoint to take the initial weights from."""
    dtype: str = "float32"
    """Compute dtype (the trainer keeps float32 parameters; a frozen model stores this)."""
    device: str = "cpu"
    """cpu (gloo) or cuda (nccl)."""
    temperature: float = 1.0
    """The generator's sampling temperature (log-probs are of logits / temperature); must equal
    `rollout.temperature`."""

    def __post_init__(self) -> None:
        require_field(self, "model_path", is_hf_checkpoint(self.model_path),
                      "a Hugging Face checkpoint folder with config.json, or a hub id 'org/name'")
        require_field(self, "family", self.family in FAMILIES, f"one of {', '.join(FAMILIES)}")
        init = self.init_checkpoint
        require_field(self, "init_checkpoint", init is None or Path(init, ".metadata").is_file(),
                      "None or a torchtitan/DCP checkpoint folder (with .metadata)")
        require_field(self, "dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        require_field(self, "device", self.device in DEVICES, f"one of {', '.join(DEVICES)}")
        require_field(self, "temperature", is_number(self.temperature) and self.temperature > 0,
                      "a number > 0 (the generator's sampling temperature)")
