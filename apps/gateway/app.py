"""The gateway's HTTP API (FastAPI): OpenAI-compatible chat completions (session keys) and the /rl session API
(admin key to start sessions). The OpenAPI schema is served at /openapi.json."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from apps.gateway.errors import openai_error
from apps.gateway.runtime import Gateway
from apps.gateway.streaming import completion_events
from apps.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    EndSessionRequest,
    EndSessionResponse,
    ErrorResponse,
    GatewayHealth,
    GatewayStats,
    ModelCard,
    ModelList,
    SetRewardRequest,
    SetRewardResponse,
    StartSessionRequest,
    StartSessionResponse,
)
from apps.http.auth import presented_key, require_key
from apps.http.errors import ServiceError
from apps.http.serving import install_error_handlers

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 422, 429, 500, 502, 504)}


def build_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="forge online-RL gateway",
                  description="OpenAI-compatible chat completions whose interactions become RL training data.",
                  version="1", responses=_ERRORS)
    install_error_handlers(app, openai_error)
    admin_key = gateway.cfg.rl.admin_api_key

    def session_of(request: Request):
        key = presented_key(request)
        if key is None:
            raise ServiceError(401, "missing session API key: send 'Authorization: Bearer <key>' (from /rl/start_session)")
        return gateway.session(key)

    @app.get("/health", response_model=GatewayHealth, tags=["service"])
    async def health() -> GatewayHealth:
        return gateway.health()

    async def chat(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | StreamingResponse:
        response = await gateway.chat(session_of(request), body)
        if not body.stream:
            return response
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(completion_events(response, include_usage=include_usage),
                                 media_type="text/event-stream")

    for path in ("/v1/chat/completions", "/chat/completions"):
        app.post(path, response_model=ChatCompletionResponse, tags=["openai"], name=f"chat{path.replace('/', '_')}")(chat)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models(request: Request) -> ModelList:
        key = presented_key(request)
        if key != admin_key:
            session_of(request)
        return ModelList(data=[ModelCard(id=gateway.cfg.chat.served_model_name, created=int(time.time()))])

    @app.post("/rl/start_session", response_model=StartSessionResponse, tags=["rl"])
    async def start_session(body: StartSessionRequest, request: Request) -> StartSessionResponse:
        require_key(request, admin_key, "admin API key")
        return await gateway.start_session(body)

    @app.post("/rl/set_reward", response_model=SetRewardResponse, tags=["rl"])
    async def set_reward(body: SetRewardRequest, request: Request) -> SetRewardResponse:
        return gateway.reward(session_of(request), body)

    @app.post("/rl/end_session", response_model=EndSessionResponse, tags=["rl"])
    async def end_session(request: Request, body: EndSessionRequest | None = None) -> EndSessionResponse:
        return await gateway.end(session_of(request), "ended by the client",
                                 return_episodes=body is not None and body.return_episodes)

    @app.get("/rl/stats", response_model=GatewayStats, tags=["rl"])
    async def stats(request: Request) -> GatewayStats:
        require_key(request, admin_key, "admin API key")
        return await gateway.stats()

    return app
