"""The served policy: the generator service and the policy version it serves. The generators start on the base
weights as version 0; each sync_inference_weights of a full-model session publishes the next version to them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from actors.generator import Generator
from apps.http.actor_calls import bounded
from apps.server.config import ServerConfig
from apps.http.errors import field_error
from apps.server.schemas import SyncWeightsRequest, SyncWeightsResponse
from apps.server.sessions import Session, SessionRegistry
from apps.server.trainer_pool import WEIGHTS
from forge.weights.startup import start_weight_store


class ServedPolicy:
    def __init__(self, cfg: ServerConfig, model_path: str, registry: SessionRegistry) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.registry = registry
        self.generators: Any = None
        self.version = 0  # the generators serve the base weights as version 0 until the first sync
        self._publish_lock = asyncio.Lock()

    async def start(self) -> None:
        await start_weight_store()
        generator_cfg = replace(self.cfg.generator, model=self.model_path, weight_namespace=WEIGHTS)
        self.generators = await Generator.options(num_replicas=self.cfg.generator_replicas,
                                                  mesh_name="generator").as_service(generator_cfg)

    def healthy_replicas(self) -> int:
        return len(self.generators.healthy_replicas()) if self.generators is not None else 0

    async def sync(self, request: SyncWeightsRequest) -> SyncWeightsResponse:
        """The session's weights published as the next policy version, loaded by every generator replica."""
        async def execute(session: Session, seq_id: int, parts: list) -> SyncWeightsResponse:
            async with self._publish_lock:  # versions reach the generators in order
                version = self.version + 1
                await session.call("publish_as", version)
                self.version = version
                versions = await bounded(self.generators.update_weights.fanout(version), self.cfg.sessions.call_timeout_s,
                                         f"generators did not load policy version {version} in time")
            return SyncWeightsResponse(model_id=session.session_id, seq_id=seq_id, policy_version=version,
                                       generator_versions=list(versions))

        def check() -> None:
            if self.registry.get(request.model_id).lora is not None:
                raise field_error(["model_id"], request.model_id, "is a LoRA session: its adapter is not published to "
                                  "the shared generators; save_weights_for_sampler(name), then sample with "
                                  "model_path=<that checkpoint>")

        return await self.registry.run_in_order(request, "sync_inference_weights", execute, check)
