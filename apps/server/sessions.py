"""A training session: one client's model (a trainer actor mesh of its own, or for a LoRA session an adapter on
the shared LoRA trainer), its request order, its idle clock and its calls into its trainer."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from apps.http.actor_calls import bounded
from apps.server.schemas import SessionInfo
from apps.server.sequencer import Sequencer
from forge.actor import rank0


@dataclass
class Session:
    session_id: str
    base_model: str
    trainer: Any  # its ServerTrainerActor; a LoRA session: the shared LoRATrainerActor
    sequencer: Sequencer
    idle_timeout_s: float
    call_timeout_s: float  # one call into the trainer (sessions.call_timeout_s)
    loaded_from: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    step: int = 0
    busy: int = 0  # requests in progress: a session working on a long request is not idle
    lora: dict[str, Any] | None = None  # a LoRA session's adapter settings (LoRAConfig's fields)

    def touch(self) -> None:
        self.last_seen = time.time()

    def idle_for(self) -> float:
        return 0.0 if self.busy else time.time() - self.last_seen

    def expires_in(self) -> float:
        return max(0.0, self.idle_timeout_s - self.idle_for())

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """The session is busy (not idle) while this block runs, and was last seen when it ends."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.touch()

    async def call(self, endpoint: str, *args: Any) -> Any:
        """`endpoint` of the session's trainer (rank 0's answer), bounded by call_timeout_s."""
        if self.lora is not None:  # the shared LoRA trainer's endpoints name the session's adapter first
            args = (self.session_id, *args)
        with self.in_use():
            return rank0(await bounded(getattr(self.trainer, endpoint).call(*args), self.call_timeout_s,
                                       f"{endpoint} did not finish within call_timeout_s={self.call_timeout_s}s"))

    def info(self) -> SessionInfo:
        return SessionInfo(session_id=self.session_id, model_id=self.session_id, base_model=self.base_model,
                           created_at=self.created_at, last_seen=self.last_seen, idle_timeout_s=self.idle_timeout_s,
                           next_seq_id=self.sequencer.next_free(), step=self.step,
                           loaded_from=self.loaded_from, metadata=self.metadata, lora=self.lora)
