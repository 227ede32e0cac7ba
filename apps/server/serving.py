"""HTTP plumbing shared by the training service and the gateway: error responses, and running uvicorn inside
the controller's event loop (next to the Monarch actors) with forge's own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from apps.server.errors import ServiceError

logger = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, error: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(status_code=error.status, content={"detail": error.detail}, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(status_code=500, content={"detail": f"{type(error).__name__}: {error}"})


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: the app stops it (and then every actor) itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(app: FastAPI, host: str, port: int, log_level: str, *, on_started: Any = None,
                stop: asyncio.Future | None = None) -> int:
    """Serve until SIGINT/SIGTERM or until `stop` completes; returns the exit status (0, or 1 if `stop` raised).
    `on_started(port)` runs once the socket listens (port 0 picks a free one)."""
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                    timeout_graceful_shutdown=5))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serving = asyncio.ensure_future(server.serve())
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started and on_started is not None:
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            on_started(bound)
        waits = [serving] + ([stop] if stop is not None else [])
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if stop is not None and stop in done:
            status = 1
            server.should_exit = True
            await asyncio.wait_for(serving, 30)
        serving.result()
        return status
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
