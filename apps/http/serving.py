"""HTTP plumbing shared by the training service and the gateway: error responses, and running uvicorn inside
the controller's event loop (next to the Monarch actors) with forge's own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from apps.http.errors import ServiceError

logger = logging.getLogger(__name__)
ErrorBody = Callable[[int, Any], dict]  # (status, detail: a message or [{loc, msg, input}]) -> response body


def detail_body(status: int, detail: Any) -> dict:
    """FastAPI's own error shape, `{"detail": ...}` (the training service; `apps.server.client` reads it)."""
    return {"detail": detail}


def install_error_handlers(app: FastAPI, body: ErrorBody = detail_body,
                           on_invalid: Callable[[Request, RequestValidationError], None] | None = None) -> None:
    """Every error the app answers, in one shape (`body`): the app's ServiceErrors, FastAPI's request validation
    (422), routing errors (404, 405) and unexpected exceptions (500, with the cause). `on_invalid` sees each
    request refused by validation first."""

    def respond(status: int, detail: Any, headers: dict | None = None) -> JSONResponse:
        if status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return JSONResponse(status_code=status, content=jsonable_encoder(body(status, detail)), headers=headers)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, error: ServiceError) -> JSONResponse:
        return respond(error.status, error.detail)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        if on_invalid is not None:
            on_invalid(request, error)
        fields = [{k: v for k, v in e.items() if k != "ctx"} for e in error.errors()]  # ctx holds exception objects
        return respond(422, fields)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        return respond(error.status_code, error.detail, dict(error.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return respond(500, f"server-side failure: {type(error).__name__}: {error}")


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: forge.lifecycle owns the signals and stops the server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(app: FastAPI, host: str, port: int, log_level: str, *, stop: Awaitable[Any],
                on_started: Callable[[int], None] | None = None) -> None:
    """Serve until `stop` completes (it raising stops the server too, and is re-raised); `on_started(port)` runs
    once the socket listens (port 0 picks a free one)."""
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                    timeout_graceful_shutdown=5))
    serving = asyncio.ensure_future(server.serve())
    stopping = asyncio.ensure_future(stop)
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started and on_started is not None:
            on_started(server.servers[0].sockets[0].getsockname()[1] if server.servers else port)
        await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await asyncio.wait_for(asyncio.shield(serving), 30)
        serving.result()
        if stopping.done():
            stopping.result()
    finally:
        stopping.cancel()
        if not serving.done():  # cancelled (a failed actor mesh): close the socket now
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(serving, 10)
