"""The training service's HTTP API (FastAPI): thin routes over `TrainingService`. The OpenAPI schema is
served at /openapi.json (interactive docs at /docs)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from apps.http.auth import require_key
from apps.http.errors import ServiceError
from apps.server.runtime import TrainingService
from apps.server.tinker.routes import TinkerPaths, build_tinker_routes
from apps.server.schemas import (
    ChunkAccepted,
    CheckpointInfo,
    CheckpointList,
    CheckpointResponse,
    CreateSessionRequest,
    DeleteCheckpointResponse,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardBackwardResponse,
    ForwardRequest,
    HealthResponse,
    HeartbeatResponse,
    LoadStateRequest,
    LoadStateResponse,
    MemoryResponse,
    OptimStepRequest,
    OptimStepResponse,
    SampleRequest,
    SampleResponse,
    SaveStateRequest,
    SaveWeightsRequest,
    ServerInfo,
    SessionInfo,
    SessionList,
    SessionRequest,
    SyncWeightsRequest,
    SyncWeightsResponse,
    UnloadResponse,
)
from apps.http.serving import install_error_handlers
from forge.provisioner import get_provisioner

# Every error status the API answers (docs/serving.md, "Error codes"), in its OpenAPI schema.
_ERRORS = {code: {"model": ErrorResponse, "description": why} for code, why in {
    400: "a Tinker-protocol request the SDK's schema refuses, naming the field (Tinker's `user` error category)",
    401: "missing or wrong API key",
    404: "unknown session (the message says why it is gone) or checkpoint",
    410: "a Tinker session that has finished (the SDK stops its heartbeat)",
    409: "a seq_id already run, refused or given up after a gap; chunks that disagree",
    422: "a field at fault: [{loc, msg, input}] naming it, or a message",
    429: "max_sessions or max_lora_sessions reached",
    500: "a server-side failure, with its cause",
    503: "no healthy generator replica left",
    504: "an actor call past its timeout (sessions.call_timeout_s, sessions.spawn_timeout_s)",
}.items()}
_CHUNKED = {**_ERRORS, 202: {"model": ChunkAccepted, "description": "a chunk stored; the request runs when all arrive"}}


def _accepted_or(result: object) -> object:
    if isinstance(result, ChunkAccepted):
        return JSONResponse(status_code=202, content=result.model_dump())
    return result


# Requests that carry a seq_id: one refused by validation gives up its place in the session's order.
_SEQUENCED = {f"/api/v1/{name}" for name in ("forward_backward", "forward", "optim_step", "save_state", "load_state",
                                             "save_weights_for_sampler", "sync_inference_weights")}


def build_app(service: TrainingService) -> FastAPI:
    app = FastAPI(title="forge training service",
                  description="Tinker-style training API over forge's trainer and generator actors.", version="1")

    def authorized(request: Request) -> None:
        if service.cfg.http.api_key is not None:
            require_key(request, service.cfg.http.api_key)

    def refuse_invalid(request: Request, error: RequestValidationError) -> None:
        if request.method != "POST" or request.url.path not in _SEQUENCED:
            return
        try:
            authorized(request)  # only the key holder may move a session's order along
        except ServiceError:
            return
        service.refuse(error.body, ServiceError(422, list(error.errors())))

    install_error_handlers(app, on_invalid=refuse_invalid)

    @app.get("/health", response_model=HealthResponse, tags=["service"])
    async def health() -> HealthResponse:
        return service.health()

    api = APIRouter(prefix="/api/v1", dependencies=[Depends(authorized)], responses=_ERRORS)

    @api.get("/health", response_model=HealthResponse, tags=["service"])
    async def api_health() -> HealthResponse:
        return service.health()

    @api.get("/get_server_info", response_model=ServerInfo, tags=["service"])
    async def server_info() -> ServerInfo:
        return service.info()

    @api.get("/memory", response_model=MemoryResponse, tags=["service"])
    async def memory() -> MemoryResponse:
        return MemoryResponse(processes=get_provisioner().memory_rss())

    # sessions
    @api.post("/create_session", response_model=SessionInfo, tags=["sessions"])
    async def create_session(body: CreateSessionRequest) -> SessionInfo:
        return await service.create_session(body)

    @api.post("/create_model", response_model=SessionInfo, tags=["sessions"], summary="create_session (xorl name)")
    async def create_model(body: CreateSessionRequest) -> SessionInfo:
        return await service.create_session(body)

    @api.post("/unload_model", response_model=UnloadResponse, tags=["sessions"])
    async def unload_model(body: SessionRequest) -> UnloadResponse:
        await service.unload(body.model_id)
        return UnloadResponse(session_id=body.model_id, unloaded=True)

    @api.post("/session_heartbeat", response_model=HeartbeatResponse, tags=["sessions"])
    async def heartbeat(body: SessionRequest) -> HeartbeatResponse:
        session = service.session(body.model_id)
        return HeartbeatResponse(session_id=session.session_id, expires_in_s=session.expires_in())

    @api.get("/sessions", response_model=SessionList, tags=["sessions"])
    async def list_sessions() -> SessionList:
        return SessionList(sessions=[s.info() for s in service.sessions.values()])

    @api.get("/sessions/{session_id}", response_model=SessionInfo, tags=["sessions"])
    async def get_session(session_id: str) -> SessionInfo:
        return service.session(session_id).info()

    # training
    @api.post("/forward_backward", response_model=ForwardBackwardResponse, responses=_CHUNKED, tags=["training"])
    async def forward_backward(body: ForwardBackwardRequest) -> object:
        return _accepted_or(await service.forward_backward(body))

    @api.post("/forward", response_model=ForwardBackwardResponse, responses=_CHUNKED, tags=["training"])
    async def forward(body: ForwardRequest) -> object:
        return _accepted_or(await service.forward(body))

    @api.post("/optim_step", response_model=OptimStepResponse, tags=["training"])
    async def optim_step(body: OptimStepRequest) -> OptimStepResponse:
        return await service.optim_step(body)

    @api.post("/save_state", response_model=CheckpointResponse, tags=["checkpoints"])
    async def save_state(body: SaveStateRequest) -> CheckpointResponse:
        return await service.save_state(body)

    @api.post("/load_state", response_model=LoadStateResponse, tags=["checkpoints"])
    async def load_state(body: LoadStateRequest) -> LoadStateResponse:
        return await service.load_state(body)

    @api.post("/save_weights_for_sampler", response_model=CheckpointResponse, tags=["checkpoints"])
    async def save_weights_for_sampler(body: SaveWeightsRequest) -> CheckpointResponse:
        return await service.save_weights_for_sampler(body)

    @api.post("/sync_inference_weights", response_model=SyncWeightsResponse, tags=["training"])
    async def sync_inference_weights(body: SyncWeightsRequest) -> SyncWeightsResponse:
        return await service.sync_inference_weights(body)

    # sampling
    @api.post("/sample", response_model=SampleResponse, tags=["sampling"])
    async def sample(body: SampleRequest) -> SampleResponse:
        return await service.sample(body)

    # checkpoints
    @api.get("/checkpoints", response_model=CheckpointList, tags=["checkpoints"])
    async def list_checkpoints() -> CheckpointList:
        return CheckpointList(checkpoints=service.checkpoints.list())

    @api.get("/checkpoints/{checkpoint_id}", response_model=CheckpointInfo, tags=["checkpoints"])
    async def get_checkpoint(checkpoint_id: str) -> CheckpointInfo:
        return service.checkpoints.get(checkpoint_id)

    @api.delete("/checkpoints/{checkpoint_id}", response_model=DeleteCheckpointResponse, tags=["checkpoints"])
    async def delete_checkpoint(checkpoint_id: str) -> DeleteCheckpointResponse:
        service.checkpoints.delete(checkpoint_id)
        return DeleteCheckpointResponse(checkpoint_id=checkpoint_id, deleted=True)

    app.include_router(api)
    # The Tinker protocol (the `tinker` SDK), over the same service; its requests on the paths both protocols use
    # are told apart by their bodies (tinker/routes.py, TinkerPaths).
    build_tinker_routes(app, service.tinker, authorized, _ERRORS)
    app.add_middleware(TinkerPaths)
    return app
