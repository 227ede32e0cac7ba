"""The REST training service over forge's trainer and generator actors.

    python -m apps.server --config configs/server_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

import asyncio
import sys
import traceback

from apps.server.app import build_app
from apps.server.config import ServerConfig
from apps.server.model import load_app_config, warm_started_model
from apps.server.runtime import TrainingService
from apps.server.serving import serve
from forge.config import ConfigError, parse_args, to_yaml
from forge.provisioner import get_provisioner, shutdown

STARTUP_TIMEOUT_S = 600.0  # spawning the generators; Monarch start-up on a loaded 2-core host has taken minutes


async def run(cfg: ServerConfig) -> int:
    model_path, accuracy = await asyncio.to_thread(warm_started_model, cfg.model, cfg.model_cache, cfg.warm_start,
                                                   seed=cfg.seed)
    service = TrainingService(cfg, model_path, accuracy)
    fatal = asyncio.ensure_future(get_provisioner().wait_for_fatal_failure())
    try:
        try:
            await asyncio.wait_for(service.start(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the generators did not start within {STARTUP_TIMEOUT_S}s") from None

        def started(port: int) -> None:
            print(f"forge training service listening on http://{cfg.http.host}:{port} "
                  f"(model {model_path}, OpenAPI at /openapi.json)", flush=True)

        status = await serve(build_app(service), cfg.http.host, cfg.http.port, cfg.http.log_level,
                             on_started=started, stop=fatal)
        if fatal.done() and not fatal.cancelled():
            failure = fatal.result()
            print(f"FATAL: actor mesh {failure.mesh_name!r} failed:\n{failure.message}", file=sys.stderr)
        return status
    except Exception:
        print("FATAL: the training service failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    finally:
        fatal.cancel()
        await service.stop()
        await asyncio.wait_for(shutdown(), timeout=60)
        print("forge training service stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0])
    try:
        cfg = load_app_config(path, overrides, ServerConfig)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    return asyncio.run(run(cfg))
