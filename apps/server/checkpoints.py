"""Checkpoints: the catalogue (`CheckpointStore`: save_state checkpoints (torchtitan/DCP, with or without the
optimizer) and save_weights_for_sampler exports (HF folders) under one root, each with a small JSON record), and a
session's checkpoint requests (`Checkpointing`), run in its seq_id order: save_state and load_state (the trainer's
weights, with or without the optimizer) and save_weights_for_sampler (an HF export), each recorded in the
catalogue."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from apps.http.errors import ServiceError, field_error, not_found
from apps.server.adapters import adapter_summary, same_adapter
from apps.server.schemas import (
    CheckpointInfo,
    CheckpointResponse,
    LoadStateRequest,
    LoadStateResponse,
    SaveStateRequest,
    SaveWeightsRequest,
)
from apps.server.sessions import Session, SessionRegistry

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

    def loadable_state(self, name: str, with_optimizer: bool, loc: list[str], *, session_id: str | None = None,
                       lora: dict[str, Any] | None = None) -> CheckpointInfo:
        """The save_state checkpoint `name`, checked to load with (or without) its optimizer; with `session_id`,
        also into that session's model (`lora`: its adapter, None for full-model weights). A 422 names `loc`."""
        info = self.get(name)  # 404 when unknown
        if info.checkpoint_type != "state":
            raise field_error(loc, name, "is a save_weights_for_sampler export; load_state takes save_state checkpoints")
        if with_optimizer and not info.with_optimizer:
            raise field_error(["with_optimizer"], True, f"checkpoint {name!r} was saved without the optimizer; "
                                                        "load it with with_optimizer=false")
        if session_id is not None and not same_adapter(lora, info.lora):
            raise field_error(loc, name, f"holds {adapter_summary(info.lora)}; session {session_id!r} trains "
                                         f"{adapter_summary(lora)}")
        return info

    def sampler_adapter(self, model_path: str) -> CheckpointInfo:
        """The LoRA save_weights_for_sampler checkpoint `model_path` names (its name or its path)."""
        name = Path(model_path).name
        known = {c.checkpoint_id: c for c in self.list()}
        info = known.get(name)
        if info is None or (name != model_path and Path(model_path).resolve() != Path(info.path)):
            raise ServiceError(404, [{"loc": ["body", "model_path"], "input": model_path, "type": "not_found",
                                      "msg": f"no checkpoint {model_path!r}; known: {', '.join(sorted(known)) or 'none'}"}])
        if info.checkpoint_type != "sampler" or info.lora is None:
            kind = "a save_state checkpoint" if info.checkpoint_type == "state" else "a full-model export"
            raise field_error(["model_path"], model_path, f"is {kind}; model_path takes a LoRA session's "
                                                          "save_weights_for_sampler checkpoint")
        return info

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


class Checkpointing:
    def __init__(self, registry: SessionRegistry, checkpoints: CheckpointStore) -> None:
        self.registry = registry
        self.checkpoints = checkpoints

    async def save_state(self, request: SaveStateRequest) -> CheckpointResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> CheckpointResponse:
            out = await session.call("save_state", str(parts[0]), request.with_optimizer)
            info = self.checkpoints.record(request.path, "state", session.session_id, int(out["step"]),
                                           request.with_optimizer, session.lora)
            return CheckpointResponse(model_id=session.session_id, seq_id=seq_id, checkpoint=info)

        return await self.registry.run_in_order(request, "save_state", execute,
                                                lambda: self.checkpoints.path_for(request.path))

    async def load_state(self, request: LoadStateRequest) -> LoadStateResponse:
        async def execute(session: Session, seq_id: int, parts: list[CheckpointInfo]) -> LoadStateResponse:
            info = parts[0]
            out = await session.call("load_state", info.path, request.with_optimizer)
            session.step = int(out["step"])
            return LoadStateResponse(model_id=session.session_id, seq_id=seq_id, checkpoint_id=info.checkpoint_id,
                                     with_optimizer=request.with_optimizer, step=session.step)

        def loadable() -> CheckpointInfo:
            session = self.registry.get(request.model_id)
            return self.checkpoints.loadable_state(request.path, request.with_optimizer, ["path"],
                                                   session_id=session.session_id, lora=session.lora)

        return await self.registry.run_in_order(request, "load_state", execute, loadable)

    async def save_weights_for_sampler(self, request: SaveWeightsRequest) -> CheckpointResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> CheckpointResponse:
            await session.call("export_hf", str(parts[0]))
            info = self.checkpoints.record(request.path, "sampler", session.session_id, session.step, False, session.lora)
            return CheckpointResponse(model_id=session.session_id, seq_id=seq_id, checkpoint=info)

        return await self.registry.run_in_order(request, "save_weights_for_sampler", execute,
                                                lambda: self.checkpoints.path_for(request.path))
