"""The Tinker protocol's HTTP routes (what the unmodified `tinker` SDK calls), over `TinkerService`.

forge's own protocol and Tinker's share six paths (create_session, create_model, session_heartbeat,
forward_backward, optim_step, save_weights_for_sampler) with different bodies. `TinkerPaths`, an ASGI middleware,
sends a request on one of them here when it is the Tinker protocol's own: a protobuf body, or a JSON body whose
`type` names the request (every Tinker request body carries it; forge's bodies refuse unknown fields, so none
does). Those routes live under /api/v1/tinker/ and are left out of the OpenAPI schema; Tinker's other paths are
its own.

The API key is checked as on every /api/v1 route (`X-API-Key`, which the SDK sends).
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from tinker import types

from apps.http.errors import ServiceError
from apps.server.tinker.service import TinkerService
from apps.server.tinker.wire import PROTOBUF, decode_forward_backward

SHARED = ("create_session", "create_model", "session_heartbeat", "forward_backward", "optim_step",
          "save_weights_for_sampler")
TINKER_PREFIX = "/api/v1/tinker"
_MAX_PEEK_BYTES = 64 << 20

Model = TypeVar("Model", bound=BaseModel)


class TinkerPaths:
    """ASGI middleware: a Tinker request on a path both protocols use goes to its Tinker route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        name = scope.get("path", "").removeprefix("/api/v1/")
        if scope["type"] != "http" or scope.get("method") != "POST" or name not in SHARED:
            await self.app(scope, receive, send)
            return
        messages, body = [], b""
        while True:  # the whole body, replayed to the route afterwards
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body") or len(body) > _MAX_PEEK_BYTES:
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if _is_tinker(name, headers.get("content-type", ""), body):
            scope = {**scope, "path": f"{TINKER_PREFIX}/{name}", "raw_path": f"{TINKER_PREFIX}/{name}".encode()}

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _is_tinker(name: str, content_type: str, body: bytes) -> bool:
    if PROTOBUF in content_type:
        return True
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("type") == name


def _parse(model: type[Model], body: Any) -> Model:
    """A request body as the SDK's own type; a 400 naming the field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:5])
        raise ServiceError(400, f"{model.__name__}: {problems}") from None


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise ServiceError(400, "the body is not JSON") from None


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


def build_tinker_routes(app: FastAPI, tinker: TinkerService, authorized: Callable,
                        responses: dict[int | str, dict[str, Any]]) -> None:
    """Tinker's routes on `app`; `responses`: the error answers every /api/v1 operation documents."""
    api = APIRouter(prefix="/api/v1", dependencies=[Depends(authorized)], tags=["tinker"], responses=responses)
    shared = APIRouter(prefix=TINKER_PREFIX, dependencies=[Depends(authorized)], include_in_schema=False)

    # -- client start-up and sessions ------------------------------------------------------------------
    @api.post("/client/config")
    async def client_config(request: Request) -> dict:
        await _json(request)
        # zstd bodies are accepted, so the SDK may compress forward_backward; custom losses run client-side.
        return _dump(types.ClientConfigResponse(proto_compress_fwdbwd=True, use_pyqwest_transport=False,
                                                sample_use_retrieve_futures=False, custom_loss_server_side=False,
                                                sample_join_sampling_session=True))

    @api.get("/get_server_capabilities")
    async def server_capabilities() -> dict:
        model = types.SupportedModel(model_name=tinker.service.model_path, trainable=True, sampleable=True,
                                     max_context_length=tinker.service.model.max_model_len)
        return _dump(types.GetServerCapabilitiesResponse(supported_models=[model]))

    @api.post("/client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return _dump(types.ClientDynamicConfigResponse(sample_cancel_enabled=False))

    @shared.post("/create_session")
    async def create_session(request: Request) -> dict:
        return _dump(tinker.create_session(_parse(types.CreateSessionRequest, await _json(request))))

    @shared.post("/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict:
        body = _parse(types.SessionHeartbeatRequest, await _json(request))
        return _dump(tinker.heartbeat(body.session_id))

    @api.post("/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict:
        return await tinker.finish(session_id)

    @api.post("/telemetry")
    async def telemetry(request: Request) -> dict:
        body = await _json(request)
        tinker.telemetry_events += len(body.get("events", [])) if isinstance(body, dict) else 0
        return {"status": "accepted"}

    # -- futures ---------------------------------------------------------------------------------------
    @api.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = _parse(types.FutureRetrieveRequest, await _json(request))
        state, value = await tinker.futures.retrieve(body.request_id)
        if state == "try_again":
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if state == "error":
            return JSONResponse(value)
        if isinstance(value, bytes):
            return Response(value, media_type=PROTOBUF)
        return JSONResponse(_dump(value))

    # -- models and training ---------------------------------------------------------------------------
    @shared.post("/create_model")
    async def create_model(request: Request) -> dict:
        return tinker.create_model(_parse(types.CreateModelRequest, await _json(request)))

    @api.post("/get_info")
    async def get_info(request: Request) -> dict:
        return _dump(tinker.get_info(_parse(types.GetInfoRequest, await _json(request)).model_id))

    @shared.post("/forward_backward")
    async def forward_backward(request: Request) -> dict:
        return tinker.forward_backward(decode_forward_backward(await request.body(),
                                                               request.headers.get("content-encoding")))

    @shared.post("/optim_step")
    async def optim_step(request: Request) -> dict:
        return tinker.optim_step(_parse(types.OptimStepRequest, await _json(request)))

    @api.post("/save_weights")
    async def save_weights(request: Request) -> dict:
        return tinker.save_weights(_parse(types.SaveWeightsRequest, await _json(request)))

    @api.post("/load_weights")
    async def load_weights(request: Request) -> dict:
        return tinker.load_weights(_parse(types.LoadWeightsRequest, await _json(request)))

    @shared.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        return tinker.save_weights_for_sampler(_parse(types.SaveWeightsForSamplerRequest, await _json(request)))

    # -- sampling --------------------------------------------------------------------------------------
    @api.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        return _dump(tinker.create_sampling_session(_parse(types.CreateSamplingSessionRequest, await _json(request))))

    @api.post("/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict:
        body = _parse(types.JoinSamplingSessionRequest, await _json(request))
        return tinker.join_sampling_session(body.sampling_session_id)

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        return _dump(tinker.get_sampler(sampler_id))

    @api.post("/asample")
    async def asample(request: Request) -> dict:
        return tinker.asample(_parse(types.SampleRequest, await _json(request)))

    # -- training runs and their checkpoints -----------------------------------------------------------
    @api.get("/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0) -> dict:
        return _dump(tinker.training_runs(limit, offset))

    @api.get("/training_runs/{model_id}")
    async def training_run(model_id: str) -> dict:
        return _dump(tinker.training_run(model_id))

    @api.get("/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict:
        return _dump(tinker.checkpoints(model_id))

    app.include_router(shared)
    app.include_router(api)
