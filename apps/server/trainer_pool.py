"""The sessions' trainers: a full-model session's trainer actor mesh (a new one, or one an unloaded session left,
reset to the served weights), and the one shared LoRA trainer on which every LoRA session is an adapter."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, replace
from typing import Any

from actors.lora_config import LoRAConfig
from apps.http.actor_calls import bounded
from apps.server.config import ServerConfig
from apps.http.errors import ServiceError
from apps.server.lora_trainer import LoRATrainerActor
from apps.server.trainer import ServerTrainerActor
from forge.actor import EndpointError

logger = logging.getLogger(__name__)
WEIGHTS = "policy"  # the weight store namespace full sessions publish to and the generators follow


class TrainerPool:
    def __init__(self, cfg: ServerConfig, model_path: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        # forge.compat, 14: Monarch 0.1.2's host agent can fail on a message to a proc mesh stopped mid-run,
        # taking every process down. So the trainer actors of unloaded sessions are kept for the next session
        # (reset to the served weights by `full_model`) rather than stopped; meshes are stopped only at
        # shutdown, as in apps.grpo.
        self.idle: list[Any] = []
        self.lora: Any = None  # every LoRA session's adapter, over one base (started by the first)
        self._lora_start = asyncio.Lock()
        self._background: set[asyncio.Future] = set()  # clean-ups nobody waits for (held so they are not collected)

    async def full_model(self) -> Any:
        """A trainer with the served model's weights: an idle one reset (see COMPAT in __init__), else a new mesh."""
        limits = self.cfg.sessions
        if self.idle:
            trainer = self.idle.pop()
            await bounded(trainer.reset.call(), limits.spawn_timeout_s,
                          f"resetting a trainer took longer than spawn_timeout_s={limits.spawn_timeout_s}s")
            return trainer
        trainer_cfg = replace(self.cfg.trainer, model_path=self.model_path)
        spawn = ServerTrainerActor.options(procs=limits.trainer_procs, mesh_name="session-trainer").as_actor(
            trainer_cfg, weight_namespace=WEIGHTS)
        return await bounded(spawn, limits.spawn_timeout_s,
                             f"the session's trainer did not start within spawn_timeout_s={limits.spawn_timeout_s}s")

    async def shared_lora(self) -> Any:
        """The one trainer of every LoRA session, started by the first one (or by sampling with an adapter saved
        by an earlier run of the server). Kept until the server stops, like the full sessions' trainers."""
        limits = self.cfg.sessions
        async with self._lora_start:
            if self.lora is None:
                trainer_cfg = replace(self.cfg.trainer, model_path=self.model_path, lora=None)
                spawn = LoRATrainerActor.options(procs=1, mesh_name="lora-trainer").as_actor(
                    trainer_cfg, sampler_seed=self.cfg.seed, max_sampler_adapters=limits.max_lora_sessions)
                self.lora = await bounded(spawn, limits.spawn_timeout_s, "the LoRA trainer did not start within "
                                                                         f"spawn_timeout_s={limits.spawn_timeout_s}s")
        return self.lora

    async def with_adapter(self, session_id: str, lora: LoRAConfig, seed: int) -> Any:
        """The shared LoRA trainer with a new adapter (and optimizer) for this session."""
        trainer = await self.shared_lora()
        timeout = self.cfg.sessions.call_timeout_s
        try:
            await bounded(trainer.add_session.call(session_id, asdict(lora), seed), timeout,
                          f"adding the adapter took longer than call_timeout_s={timeout}s")
        except ServiceError as error:
            if error.status == 504:
                # The add still runs later (the trainer takes its calls one at a time, in order): remove what it
                # adds, or the adapter would hold memory with no session to use or count it.
                removal = asyncio.ensure_future(self.remove_adapter(trainer, session_id))
                self._background.add(removal)
                removal.add_done_callback(self._background.discard)
            raise
        return trainer

    async def release(self, session: Any) -> None:  # a sessions.Session (which imports this module)
        """A full session's trainer is kept, reset when the next session takes it; a LoRA session's adapter and
        optimizer state are deleted from the shared trainer."""
        if session.lora is None:
            self.idle.append(session.trainer)
            return
        await self.remove_adapter(session.trainer, session.session_id)

    async def remove_adapter(self, trainer: Any, session_id: str) -> None:
        try:
            await asyncio.wait_for(trainer.remove_session.call(session_id), self.cfg.sessions.call_timeout_s)
        except (asyncio.TimeoutError, EndpointError) as error:
            logger.warning("removing the adapter of session %s failed: %s", session_id, error)
