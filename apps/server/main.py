"""The REST training service over forge's trainer and generator actors.

    python -m apps.server --config configs/server_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

from typing import Any

from apps.http.main import HttpApp, run_http_app
from apps.server.config import ServerConfig


def _open(cfg: ServerConfig, model_path: str, warm_start_accuracy: float | None) -> tuple[Any, Any]:
    from apps.server.app import build_app
    from apps.server.runtime import TrainingService

    service = TrainingService(cfg, model_path, warm_start_accuracy)
    return service, build_app(service)


def main(argv: list[str] | None = None) -> int:
    return run_http_app(HttpApp("forge training service", __doc__, ServerConfig, _open), argv)
