"""The OpenAI-compatible online-RL gateway: chats become training data, training runs by itself.

    python -m apps.gateway --config configs/gateway_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

from apps.gateway.config import GatewayConfig
from apps.app_config import load_app_config
from forge.config import ConfigError, parse_args, to_yaml
from forge.lifecycle import run_job

if TYPE_CHECKING:
    from apps.gateway.runtime import Gateway

STARTUP_TIMEOUT_S = 600.0  # spawning every actor; Monarch start-up on a loaded 2-core host has taken minutes


async def _stopped(gateway: Gateway, stop: asyncio.Event) -> None:
    """Returns when `stop` is set; raises when a background task of the gateway (the reaper, the training loop)
    ends, since the gateway cannot go on without it."""
    asked = asyncio.ensure_future(stop.wait())
    watch = asyncio.ensure_future(gateway.watch())
    try:
        await asyncio.wait([asked, watch], return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():
            watch.result()
            raise RuntimeError("a gateway background task stopped")
    finally:
        asked.cancel()
        watch.cancel()


async def run(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set. Signals, a failed actor mesh and the final clean-up of every process are
    forge.lifecycle's (`run_job`)."""
    # The stack (torch, Monarch, the web server) is imported once the config has been checked.
    from apps.gateway.app import build_app
    from apps.gateway.runtime import Gateway
    from apps.server.model import warm_started_model
    from apps.server.serving import serve

    model_path, _ = await asyncio.to_thread(warm_started_model, cfg.model, cfg.model_cache, cfg.warm_start, seed=cfg.seed)
    gateway = Gateway(cfg, model_path)
    try:
        try:
            await asyncio.wait_for(gateway.start(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the actors did not start within {STARTUP_TIMEOUT_S}s") from None

        def started(port: int) -> None:
            print(f"forge online-RL gateway listening on http://{cfg.http.host}:{port} (model {model_path}, "
                  f"capacity {cfg.capacity}, OpenAPI at /openapi.json)", flush=True)

        await serve(build_app(gateway), cfg.http.host, cfg.http.port, cfg.http.log_level, on_started=started,
                    stop=_stopped(gateway, stop))
    finally:
        await gateway.stop()
        print("forge online-RL gateway stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0])
    try:
        cfg = load_app_config(path, overrides, GatewayConfig)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    stop = asyncio.Event()
    return run_job(lambda: run(cfg, stop), on_stop=lambda signal_name: stop.set())
