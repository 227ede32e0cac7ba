"""Trainer checkpoints on disk: DCP folders that are complete or absent (written under `<path>.partial`, renamed
when done) with the size and CRC32 of every file, and Hugging Face exports that transformers loads.

Every function is called on every rank with the same arguments; the ranks share the work and rank 0 renames.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.config import TORCH_DTYPE_MAP

CHECKSUMS_FILE = "checksums.json"
OPTIMIZER_PARTS = ("optimizer", "lr_scheduler")  # what a weights-only checkpoint (apps.server's save_state) leaves out
TRAINER_PARTS = (*OPTIMIZER_PARTS, "train_state", "lora")  # a checkpoint's top-level keys beside the model's
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def is_model_key(key: str) -> bool:
    """Whether `key` of a trainer checkpoint (a state-dict key, or a flattened one like `optimizer.state.x`) holds
    the model's weights rather than one of the TRAINER_PARTS saved beside them."""
    return key.split(".")[0] not in TRAINER_PARTS


# torchtitan 0.3.0 renamed the modules of forge's models: the unembedding `output` is `lm_head`, and q, k and v
# moved under `attention.qkv_linear`. A checkpoint written by forge on torchtitan 0.2.0 holds the old names, in its
# model keys, its LoRA adapter keys and its optimizer state's keys (`optimizer.state.<param>.exp_avg`).
_RENAMED = ((re.compile(r"(^|\.)lm_head\."), r"\1output."),
            (re.compile(r"\.attention\.qkv_linear\.(w[qkv])\."), r".attention.\1."))
_LEGACY_KEY = re.compile(r"(^|\.)output\.|\.attention\.w[qkv]\.")


def legacy_name(key: str) -> str:
    """The name torchtitan 0.2.0 gave what `key` (a torchtitan 0.3.0 checkpoint key) names."""
    for pattern, old in _RENAMED:
        key = pattern.sub(old, key)
    return key


def current_name(key: str) -> str:
    """The inverse of `legacy_name`: a torchtitan 0.2.0 checkpoint key under torchtitan 0.3.0's names."""
    key = re.sub(r"(^|\.)output\.", r"\1lm_head.", key)
    return re.sub(r"\.attention\.(w[qkv])\.", r".attention.qkv_linear.\1.", key)


def is_legacy(path: Path) -> bool:
    """Whether the DCP checkpoint at `path` was written under torchtitan 0.2.0's names (forge before torchtitan
    0.3.0). False where there is no checkpoint metadata: loading it reports what is missing."""
    if not (path / ".metadata").is_file():
        return False
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(_LEGACY_KEY.search(key) for key in keys)


def names_in(path: Path) -> Callable[[str], str]:
    """How the checkpoint at `path` names a torchtitan 0.3.0 key: itself, or its 0.2.0 name."""
    return legacy_name if is_legacy(path) else (lambda key: key)


class LegacyNames(Stateful):
    """A stateful part (the optimizer) whose state-dict keys a torchtitan 0.2.0 checkpoint holds under the old
    module names: loads them into the part under the new ones."""

    def __init__(self, part: Any) -> None:
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        return {legacy_name(k): v for k, v in self.part.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.part.load_state_dict({current_name(k): v for k, v in state_dict.items()})


def in_checkpoint_names(states: dict[str, Any], path: Path) -> tuple[dict[str, Any], Callable[[str], str]]:
    """`states` (model keys at the top level, then stateful parts) as the checkpoint at `path` names them, and the
    renaming used: a torchtitan 0.2.0 checkpoint gets its old model keys and an optimizer that reads old names."""
    if not is_legacy(path):
        return states, lambda key: key
    renamed = {legacy_name(k) if is_model_key(k) else k: v for k, v in states.items()}
    if "optimizer" in renamed:
        renamed["optimizer"] = LegacyNames(renamed["optimizer"])
    return renamed, legacy_name


def save(states: dict[str, Any], path: Path, *, rank: int, world_size: int) -> str:
    """Save `states` (torchtitan's layout: model keys at the top level, then stateful parts) with DCP, each rank
    writing its shards, plus CHECKSUMS_FILE; `path` is either absent or complete."""
    staging = path.with_name(path.name + ".partial")
    if rank == 0:
        _fresh_staging_dir(path)
    _barrier(world_size)
    # dcp.save returns on every rank only after rank 0 has written .metadata, the last file.
    dcp.save(states, checkpoint_id=str(staging), no_dist=world_size == 1)
    checksums = _file_checksums(staging, sorted(f.name for f in staging.iterdir()), rank, world_size)
    if rank == 0:
        (staging / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1))
        _move_into_place(staging, path)
    _barrier(world_size)
    return str(path)


def load(states: dict[str, Any], path: Path, *, rank: int, world_size: int) -> None:
    """Load what `save` wrote into `states` (in place). Raises FileNotFoundError for an incomplete folder and
    RuntimeError for a corrupt one or one that does not match `states`."""
    if not (path / CHECKSUMS_FILE).is_file():
        raise FileNotFoundError(f"load_checkpoint: {path} is not a complete checkpoint: no {CHECKSUMS_FILE} "
                                "(save_checkpoint writes it last)")
    expected = json.loads((path / CHECKSUMS_FILE).read_text())
    missing = sorted(name for name in expected if not (path / name).is_file())
    if missing:
        raise FileNotFoundError(f"load_checkpoint: {path} is missing {missing}")
    found = _file_checksums(path, sorted(expected), rank, world_size)
    corrupt = sorted(name for name, value in found.items() if value != expected[name])
    if corrupt:
        raise RuntimeError(f"load_checkpoint: {path} is corrupt: {corrupt} differ from the size and CRC32 "
                           f"recorded in {CHECKSUMS_FILE} when it was saved")
    try:
        dcp.load(states, checkpoint_id=str(path), no_dist=world_size == 1)
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        causes = [exc for exc, _ in e.failures.values()] if isinstance(e, dcp.CheckpointException) else [e]
        reasons = "; ".join(f"{type(c).__name__}: {c}" for c in causes)
        raise RuntimeError(f"load_checkpoint: {path} does not match this model and optimizer ({reasons})") from e


def source_dtype(model_path: Path) -> torch.dtype:
    """The dtype a Hugging Face checkpoint stores its weights in (float32 when its config.json does not say)."""
    hf_config = json.loads((model_path / "config.json").read_text())
    return TORCH_DTYPE_MAP.get(hf_config.get("torch_dtype") or hf_config.get("dtype"), torch.float32)


def export_hf(hf_state: dict[str, torch.Tensor] | None, source: Path, path: Path, *, rank: int,
              world_size: int) -> str:
    """Write a HF checkpoint folder: model.safetensors from rank 0's full `hf_state` (None on the other ranks),
    config.json and tokenizer files copied from the `source` checkpoint."""
    if rank == 0:
        staging = _fresh_staging_dir(path)
        save_file({k: v.contiguous().cpu() for k, v in hf_state.items()}, staging / "model.safetensors",
                  metadata={"format": "pt"})
        for file in source.iterdir():
            if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(file, staging / file.name)
        _move_into_place(staging, path)
    _barrier(world_size)
    return str(path)


def _file_checksums(folder: Path, names: list[str], rank: int, world_size: int) -> dict[str, list[int]]:
    """[size, CRC32] of each named file; the ranks share the reading."""
    mine = {name: [(folder / name).stat().st_size, _crc32(folder / name)] for name in names[rank::world_size]}
    if world_size == 1:
        return mine
    shares: list[dict[str, list[int]]] = [{} for _ in range(world_size)]
    dist.all_gather_object(shares, mine)
    return {name: value for share in shares for name, value in share.items()}


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fresh_staging_dir(path: Path) -> Path:
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
    staging.mkdir(parents=True)
    return staging


def _move_into_place(staging: Path, path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    os.rename(staging, path)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
