"""The checkpoint catalogue: save_state checkpoints (torchtitan/DCP, with or without the optimizer) and
save_weights_for_sampler exports (HF folders) under one root, each with a small JSON record."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from apps.server.errors import ServiceError, not_found
from apps.server.schemas import CheckpointInfo

RECORD = "forge_checkpoint.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, name: str) -> Path:
        if not _NAME.fullmatch(name) or name.endswith(".partial"):
            raise ServiceError(422, f"checkpoint name {name!r}: must match {_NAME.pattern} (letters, digits, "
                                    "'_', '.', '-'), not ending in .partial")
        return self.root / name

    def record(self, name: str, kind: str, session_id: str, step: int, with_optimizer: bool,
               lora: dict | None = None) -> CheckpointInfo:
        path = self.path_for(name)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        info = CheckpointInfo(checkpoint_id=name, checkpoint_type=kind, path=str(path), session_id=session_id,
                              step=step, with_optimizer=with_optimizer, created_at=time.time(), size_bytes=size,
                              lora=lora)
        (path / RECORD).write_text(info.model_dump_json(indent=1))
        return info

    def get(self, name: str) -> CheckpointInfo:
        record = self.path_for(name) / RECORD
        if not record.is_file():
            raise not_found("checkpoint", name, [c.checkpoint_id for c in self.list()])
        return CheckpointInfo.model_validate(json.loads(record.read_text()))

    def list(self) -> list[CheckpointInfo]:
        infos = []
        for record in sorted(self.root.glob(f"*/{RECORD}")):
            try:
                infos.append(CheckpointInfo.model_validate(json.loads(record.read_text())))
            except ValueError:
                continue  # a record being written or damaged: not a usable checkpoint
        return sorted(infos, key=lambda c: c.created_at)

    def delete(self, name: str) -> CheckpointInfo:
        info = self.get(name)
        shutil.rmtree(self.path_for(name))
        return info
