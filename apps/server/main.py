"""The REST training service over forge's trainer and generator actors.

    python -m apps.server --config configs/server_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

import asyncio
import sys

from apps.server.config import ServerConfig
from apps.app_config import load_app_config
from forge.config import ConfigError, parse_args, to_yaml
from forge.lifecycle import run_job

STARTUP_TIMEOUT_S = 600.0  # spawning the generators; Monarch start-up on a loaded 2-core host has taken minutes


async def run(cfg: ServerConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set. Signals, a failed actor mesh and the final clean-up of every process are
    forge.lifecycle's (`run_job`)."""
    # The stack (torch, Monarch, the web server) is imported once the config has been checked.
    from apps.server.app import build_app
    from apps.server.model import warm_started_model
    from apps.server.runtime import TrainingService
    from apps.server.serving import serve

    model_path, accuracy = await asyncio.to_thread(warm_started_model, cfg.model, cfg.model_cache, cfg.warm_start,
                                                   seed=cfg.seed)
    service = TrainingService(cfg, model_path, accuracy)
    try:
        try:
            await asyncio.wait_for(service.start(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the generators did not start within {STARTUP_TIMEOUT_S}s") from None

        def started(port: int) -> None:
            print(f"forge training service listening on http://{cfg.http.host}:{port} "
                  f"(model {model_path}, OpenAPI at /openapi.json)", flush=True)

        await serve(build_app(service), cfg.http.host, cfg.http.port, cfg.http.log_level, on_started=started,
                    stop=stop.wait())
    finally:
        await service.stop()
        print("forge training service stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0])
    try:
        cfg = load_app_config(path, overrides, ServerConfig)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    stop = asyncio.Event()
    return run_job(lambda: run(cfg, stop), on_stop=lambda signal_name: stop.set())
