"""The OpenAI-compatible online-RL gateway: chats become training data, training runs by itself.

    python -m apps.gateway --config configs/gateway_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

import asyncio
import sys
import traceback

from apps.gateway.app import build_app
from apps.gateway.config import GatewayConfig
from apps.gateway.runtime import Gateway
from apps.server.model import load_app_config, warm_started_model
from apps.server.serving import serve
from forge.config import ConfigError, parse_args, to_yaml
from forge.provisioner import get_provisioner, shutdown

STARTUP_TIMEOUT_S = 600.0  # spawning every actor; Monarch start-up on a loaded 2-core host has taken minutes


async def _first_failure(gateway: Gateway) -> None:
    fatal = asyncio.ensure_future(get_provisioner().wait_for_fatal_failure())
    watch = asyncio.ensure_future(gateway.watch())
    try:
        done, _ = await asyncio.wait([fatal, watch], return_when=asyncio.FIRST_COMPLETED)
        if fatal in done:
            failure = fatal.result()
            raise RuntimeError(f"actor mesh {failure.mesh_name!r} failed:\n{failure.message}")
        watch.result()
        raise RuntimeError("a gateway background task stopped")
    finally:
        fatal.cancel()
        watch.cancel()


async def run(cfg: GatewayConfig) -> int:
    model_path, _ = await asyncio.to_thread(warm_started_model, cfg.model, cfg.model_cache, cfg.warm_start, seed=cfg.seed)
    gateway = Gateway(cfg, model_path)
    failure: asyncio.Future | None = None
    try:
        try:
            await asyncio.wait_for(gateway.start(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the actors did not start within {STARTUP_TIMEOUT_S}s") from None
        failure = asyncio.ensure_future(_first_failure(gateway))

        def started(port: int) -> None:
            print(f"forge online-RL gateway listening on http://{cfg.http.host}:{port} (model {model_path}, "
                  f"capacity {cfg.capacity}, OpenAPI at /openapi.json)", flush=True)

        status = await serve(build_app(gateway), cfg.http.host, cfg.http.port, cfg.http.log_level, on_started=started,
                             stop=failure)
        if failure.done() and not failure.cancelled() and failure.exception() is not None:
            error = failure.exception()
            print("FATAL: " + "".join(traceback.format_exception(error)), file=sys.stderr)
        return status
    except Exception:
        print("FATAL: the gateway failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    finally:
        if failure is not None:
            failure.cancel()
        await gateway.stop()
        await asyncio.wait_for(shutdown(), timeout=60)
        print("forge online-RL gateway stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    path, overrides, _ = parse_args(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0])
    try:
        cfg = load_app_config(path, overrides, GatewayConfig)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), flush=True)
    return asyncio.run(run(cfg))
