"""The OpenAI-compatible online-RL gateway: chats become training data, training runs by itself.

    python -m apps.gateway --config configs/gateway_tiny.yaml [key=value ...]

Config errors are reported before any process starts; the tiny model is warm-started the way apps.grpo
does it. The API is described in docs/serving.md and at http://HOST:PORT/docs.
"""

from __future__ import annotations

from typing import Any

from apps.gateway.config import GatewayConfig
from apps.http.main import HttpApp, run_http_app


def _open(cfg: GatewayConfig, model_path: str, warm_start_accuracy: float | None) -> tuple[Any, Any]:
    from apps.gateway.app import build_app
    from apps.gateway.runtime import Gateway

    gateway = Gateway(cfg, model_path)
    return gateway, build_app(gateway)


def main(argv: list[str] | None = None) -> int:
    return run_http_app(HttpApp("forge online-RL gateway", __doc__, GatewayConfig, _open,
                                about=lambda cfg, model_path: f"model {model_path}, capacity {cfg.capacity}"), argv)
