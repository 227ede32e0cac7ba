"""The training service: its parts wired together, started and stopped, behind the one object the HTTP layer
(app.py) talks to. Each part has one job:

- `SessionRegistry` (sessions.py): the open sessions, their limits, idle unloading, seq_id order;
- `TrainerPool` (trainer_pool.py): the sessions' trainers (full-model meshes, the shared LoRA trainer);
- `Training` (training.py): forward, forward_backward, optim_step;
- `Checkpointing` (checkpoints.py): save_state, load_state, save_weights_for_sampler;
- `ServedPolicy` (policy.py): the generator service and its policy version, sync_inference_weights;
- `Sampler` (sampling.py): sample;
- `CheckpointStore` (checkpoints.py): the checkpoint catalogue;
- `TinkerService` (tinker/service.py): the Tinker protocol's sessions, models, futures and samplers over the parts
  above (its routes: tinker/routes.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from apps.server.checkpoints import Checkpointing, CheckpointStore
from apps.server.config import ServerConfig
from apps.http.errors import ServiceError
from apps.http.model import tokenizer_info
from apps.server.policy import ServedPolicy
from apps.server.sampling import Sampler
from apps.server.schemas import (
    ChunkAccepted,
    CheckpointResponse,
    CreateSessionRequest,
    ForwardBackwardRequest,
    ForwardBackwardResponse,
    ForwardRequest,
    HealthResponse,
    LoadStateRequest,
    LoadStateResponse,
    OptimStepRequest,
    OptimStepResponse,
    SampleRequest,
    SampleResponse,
    SaveStateRequest,
    SaveWeightsRequest,
    ServerInfo,
    SessionInfo,
    SyncWeightsRequest,
    SyncWeightsResponse,
)
from apps.server.sessions import Session, SessionRegistry
from apps.server.tinker.service import TinkerService
from apps.server.trainer_pool import TrainerPool
from apps.server.training import Training
from losses import LOSSES


class TrainingService:
    def __init__(self, cfg: ServerConfig, model_path: str, warm_start_accuracy: float | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.warm_start_accuracy = warm_start_accuracy
        self.model = tokenizer_info(model_path)
        self.started_at = time.time()
        self.checkpoints = CheckpointStore(Path(cfg.run_dir) / "checkpoints")
        self.trainers = TrainerPool(cfg, model_path)
        self.registry = SessionRegistry(cfg, model_path, self.trainers, self.checkpoints)
        self.policy = ServedPolicy(cfg, model_path, self.registry)
        self.training = Training(cfg, self.model, self.registry)
        self.checkpointing = Checkpointing(self.registry, self.checkpoints)
        self.sampler = Sampler(cfg, self.model, self.policy, self.trainers, self.checkpoints)
        self.tinker = TinkerService(self)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.policy.start()
        self.registry.start_reaper()

    async def watch(self) -> None:
        """Returns (or raises) only if a background task (the idle sessions' reaper) ends: the server stops."""
        await self.registry.watch()

    async def stop(self) -> None:
        await self.registry.close("the server is shutting down")

    # -- the parts' state, by the names tests and the HTTP layer use ----------------------------------
    @property
    def sessions(self) -> dict[str, Session]:
        return self.registry.sessions

    @property
    def creating(self) -> dict[str, int]:
        return self.registry.creating

    @property
    def idle_trainers(self) -> list[Any]:
        return self.trainers.idle

    @idle_trainers.setter
    def idle_trainers(self, trainers: list[Any]) -> None:
        self.trainers.idle = trainers

    @property
    def generators(self) -> Any:
        return self.policy.generators

    @generators.setter
    def generators(self, generators: Any) -> None:
        self.policy.generators = generators

    # -- service -------------------------------------------------------------------------------------
    def health(self) -> HealthResponse:
        return HealthResponse(status="ok", model=self.model_path, policy_version=self.policy.version,
                              sessions=len(self.sessions), max_sessions=self.cfg.sessions.max_sessions,
                              generator_replicas_healthy=self.policy.healthy_replicas(),
                              uptime_s=time.time() - self.started_at)

    def info(self) -> ServerInfo:
        return ServerInfo(model=self.model_path, pad_id=self.model.pad_id, eos_id=self.model.eos_id,
                          vocab_size=self.model.vocab_size, max_model_len=self.model.max_model_len,
                          policy_version=self.policy.version, loss_fns=list(LOSSES),
                          warm_start_accuracy=self.warm_start_accuracy)

    # -- requests, each answered by its part ---------------------------------------------------------
    def session(self, session_id: str) -> Session:
        return self.registry.get(session_id)

    async def create_session(self, request: CreateSessionRequest, session_id: str | None = None) -> SessionInfo:
        return await self.registry.create(request, session_id)

    async def unload(self, session_id: str, reason: str = "unloaded by the client") -> None:
        await self.registry.unload(session_id, reason)

    def refuse(self, body: Any, error: ServiceError) -> None:
        self.registry.refuse(body, error)

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        return await self.training.forward_backward(request)

    async def forward(self, request: ForwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        return await self.training.forward(request)

    async def optim_step(self, request: OptimStepRequest) -> OptimStepResponse:
        return await self.training.optim_step(request)

    async def save_state(self, request: SaveStateRequest) -> CheckpointResponse:
        return await self.checkpointing.save_state(request)

    async def load_state(self, request: LoadStateRequest) -> LoadStateResponse:
        return await self.checkpointing.load_state(request)

    async def save_weights_for_sampler(self, request: SaveWeightsRequest) -> CheckpointResponse:
        return await self.checkpointing.save_weights_for_sampler(request)

    async def sync_inference_weights(self, request: SyncWeightsRequest) -> SyncWeightsResponse:
        return await self.policy.sync(request)

    async def sample(self, request: SampleRequest) -> SampleResponse:
        return await self.sampler.sample(request)
