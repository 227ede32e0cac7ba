"""One main() for the apps that serve HTTP over forge's actors (`python -m apps.server`, `python -m apps.gateway`):
the arguments, the config checked before any process starts, the served model warm-started the way apps.grpo does
it, then the app served until a signal, under forge.lifecycle.run_job (signals, a failed actor mesh, the exit code
and the clean-up of every process). Each app names itself, its config and how to open its service."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from apps.app_config import load_app_config
from forge.config import ConfigError, parse_args, to_yaml
from forge.lifecycle import run_job

if TYPE_CHECKING:
    from fastapi import FastAPI

STARTUP_TIMEOUT_S = 600.0  # spawning the actors: Monarch start-up on a loaded small host can take minutes


class Service(Protocol):
    """What an HTTP app serves: started before its socket listens, stopped after the socket closes."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def watch(self) -> None:
        """Returns (or raises) when a background task the service cannot go on without has ended."""


@dataclass(frozen=True)
class HttpApp:
    name: str  # "forge training service": its start-up and stop lines say it
    doc: str  # the app's module docstring: its first line is --help's description
    config: type  # the config dataclass, checked before anything starts
    # (config, served model path, warm-start accuracy) -> the service and its HTTP app. Imports the stack (torch,
    # Monarch, the web server): it is called once the config has been checked.
    open: Callable[[Any, str, float | None], tuple[Service, FastAPI]]
    # What the listening line says of the running app, given (config, served model path).
    about: Callable[[Any, str], str] = lambda cfg, model_path: f"model {model_path}"


def run_http_app(app: HttpApp, argv: list[str] | None = None) -> int:
    """`python -m <app>`: parse the arguments, check the config (exit code 2 naming the bad key), serve until a
    signal; returns the exit code."""
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=app.doc.splitlines()[0])
    try:
        cfg = load_app_config(path, overrides, app.config)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    stop = asyncio.Event()
    return run_job(lambda: _serve(app, cfg, stop), on_stop=lambda signal_name: stop.set())


async def _serve(app: HttpApp, cfg: Any, stop: asyncio.Event) -> None:
    """Serve until `stop` is set or the service's watch ends."""
    from apps.http.model import model_to_serve
    from apps.http.serving import serve

    model_path, accuracy = await asyncio.to_thread(model_to_serve, cfg.model, cfg.model_cache, cfg.warm_start,
                                                   seed=cfg.seed, reverse_answer=getattr(cfg, "reverse_answer", False))
    service, http_app = app.open(cfg, model_path, accuracy)
    try:
        try:
            await asyncio.wait_for(service.start(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{app.name}: its actors did not start within {STARTUP_TIMEOUT_S}s") from None

        def started(port: int) -> None:
            print(f"{app.name} listening on http://{cfg.http.host}:{port} ({app.about(cfg, model_path)}, OpenAPI at "
                  "/openapi.json)", flush=True)

        await serve(http_app, cfg.http.host, cfg.http.port, cfg.http.log_level, on_started=started,
                    stop=_stopped(service, stop, app.name))
    finally:
        await service.stop()
        print(f"{app.name} stopped", flush=True)


async def _stopped(service: Service, stop: asyncio.Event, name: str) -> None:
    """Returns when `stop` is set; raises when the service's watch ends, since it cannot go on without the
    background task that ended."""
    asked = asyncio.ensure_future(stop.wait())
    watch = asyncio.ensure_future(service.watch())
    try:
        await asyncio.wait([asked, watch], return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():
            watch.result()
            raise RuntimeError(f"a background task of the {name} stopped")
    finally:
        asked.cancel()
        watch.cancel()
