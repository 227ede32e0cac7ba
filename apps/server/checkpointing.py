"""A session's checkpoint requests, run in its seq_id order: save_state and load_state (the trainer's weights, with
or without the optimizer) and save_weights_for_sampler (an HF export), each recorded in the checkpoint catalogue."""

from __future__ import annotations

from apps.server.checkpoint_store import CheckpointStore
from apps.server.schemas import (
    CheckpointInfo,
    CheckpointResponse,
    LoadStateRequest,
    LoadStateResponse,
    SaveStateRequest,
    SaveWeightsRequest,
)
from apps.server.sessions import Session, SessionRegistry


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
