"""What an evaluation evaluates, found on disk before anything starts: plain Python, no torch.

    model (an HF folder, `tiny`)            -> one version, the generator's own weights
    checkpoint (a step checkpoint or export) -> one version: its weights on `model`'s architecture and tokenizer
    run_dir (every step checkpoint of a run) -> `model` as step 0 (include_base), then each step in order
    endpoint (an OpenAI-compatible server)   -> one version, asked over HTTP

Layouts (apps/run_checkpoints.py, actors/checkpoint.py): a run's `checkpoints/step_NNNNNN/` holds `trainer/`, a DCP
folder that is complete when its `checksums.json` exists; `hf_model/` is its Hugging Face export (config.json,
model.safetensors, tokenizer files); a LoRA run exports a peft adapter folder instead (adapter_config.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHECKSUMS_FILE = "checksums.json"  # actors/checkpoint.py writes it last: a DCP folder without it is incomplete
_STEP = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class ModelVersion:
    """One model to evaluate: an HF folder, a trainer checkpoint (DCP) or an endpoint's base URL."""

    label: str
    kind: Literal["hf", "checkpoint", "endpoint"]
    path: str
    step: int | None = None  # a run's step (its base: 0); None outside a run


def checkpoint_version(path: str, field: str = "checkpoint") -> ModelVersion:
    """A step folder (`step_NNNNNN/`, its `trainer/` inside), a trainer DCP folder, or an HF export folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{field}={path!r}: no such folder; give a run's checkpoints/step_NNNNNN folder, its "
                         "trainer/ folder, or a Hugging Face export (hf_model/)")
    step = _step_of(folder)
    if (folder / "trainer" / CHECKSUMS_FILE).is_file():
        return ModelVersion(folder.name, "checkpoint", str(folder / "trainer"), step)
    if (folder / CHECKSUMS_FILE).is_file():
        name = folder.parent.name if folder.name == "trainer" else folder.name
        return ModelVersion(name, "checkpoint", str(folder), _step_of(folder.parent) if step is None else step)
    if (folder / "adapter_config.json").is_file():
        raise ValueError(f"{field}={path!r}: a LoRA adapter (peft) folder; apps.eval evaluates full weights: merge the "
                         "adapter into its base model and give that folder")
    if (folder / "config.json").is_file():
        return ModelVersion(folder.name, "hf", str(folder), step)
    raise ValueError(f"{field}={path!r}: neither a step checkpoint (no trainer/{CHECKSUMS_FILE}: incomplete or not "
                     f"one), a trainer checkpoint ({CHECKSUMS_FILE}) nor a Hugging Face folder (config.json)")


def run_checkpoints(run_dir: str, field: str = "run_dir") -> list[ModelVersion]:
    """Every complete step checkpoint of a run, oldest first: `run_dir/checkpoints/step_*` (apps.grpo's default
    `checkpoint.folder`), or `run_dir/step_*` when given the checkpoints folder itself."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"{field}={run_dir!r}: no such folder")
    for folder in (root / "checkpoints", root):
        steps = [checkpoint_version(str(p), field) for p in folder.glob("step_*")
                 if _STEP.fullmatch(p.name) and (p / "trainer" / CHECKSUMS_FILE).is_file()]
        if steps:
            return sorted(steps, key=lambda v: v.step)
    raise ValueError(f"{field}={run_dir!r}: holds no complete step checkpoint (looked for "
                     f"{root / 'checkpoints'}/step_NNNNNN/trainer/{CHECKSUMS_FILE} and {root}/step_NNNNNN/...); a GRPO "
                     "run writes them every checkpoint.interval steps and keeps the newest checkpoint.keep")


def model_label(model: str) -> str:
    return Path(model).name or model


def _step_of(folder: Path) -> int | None:
    match = _STEP.fullmatch(folder.name)
    return int(match.group(1)) if match else None
