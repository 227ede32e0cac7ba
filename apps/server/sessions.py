"""Training sessions: a session (one client's model: a trainer actor mesh of its own, or for a LoRA session an adapter
on the shared LoRA trainer, with its request order, its idle clock and its calls into its trainer), and the open
sessions (`SessionRegistry`): creating one (within the session limits), finding one by id, unloading one (by the
client, or by the reaper once it is idle for its idle_timeout_s), and running a session's requests in seq_id order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from apps.http.actor_calls import bounded
from apps.http.errors import ServiceError, field_error, not_found
from apps.server.adapters import session_lora
from apps.server.config import ServerConfig
from apps.server.schemas import ChunkAccepted, CreateSessionRequest, SequencedRequest, SessionInfo
from apps.server.sequencer import Sequencer
from apps.server.trainer_pool import TrainerPool
from forge.actor import rank0
from rl.tiny_model import TINY_CHECKPOINT_DIR, TINY_MODEL

logger = logging.getLogger(__name__)


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


Execute = Callable[[Session, int, list], Awaitable[Any]]  # (the session, its seq_id, the request's parts in order)


class SessionRegistry:
    # checkpoints: the checkpoints.CheckpointStore (that module imports this one), for create's from_checkpoint
    def __init__(self, cfg: ServerConfig, model_path: str, trainers: TrainerPool, checkpoints: Any) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.trainers = trainers
        self.checkpoints = checkpoints
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # session id -> why it is gone
        self.creating = {"full": 0, "lora": 0}
        self._reaper: asyncio.Task | None = None

    def get(self, session_id: str) -> Session:
        """The open session `session_id`, touched (a request keeps it alive); a 404 saying why when it is gone."""
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.ended:
                raise ServiceError(404, f"session {session_id!r} was unloaded: {self.ended[session_id]}")
            raise not_found("session", session_id, list(self.sessions))
        session.touch()
        return session

    # -- creating and unloading ----------------------------------------------------------------------
    def served_names(self) -> list[str]:
        names = [self.model_path, str(Path(self.model_path).resolve())]
        configured = self.cfg.model
        names += [configured, str(Path(configured).resolve())] if configured else []
        if Path(configured).name == TINY_CHECKPOINT_DIR:
            names.append(TINY_MODEL)
        return names

    async def create(self, request: CreateSessionRequest, session_id: str | None = None) -> SessionInfo:
        """A new session (named `session_id`, or a fresh id): a full-model trainer or a LoRA adapter."""
        limits = self.cfg.sessions
        if session_id is not None and (session_id in self.sessions or session_id in self.ended):
            raise field_error(["model_id"], session_id, "is already taken by a session of this server")
        if request.base_model is not None and request.base_model not in self.served_names():
            raise field_error(["base_model"], request.base_model,
                              f"this server trains only {self.model_path!r} (or 'tiny' / the configured model "
                              f"{self.cfg.model!r}); omit base_model to use it")
        idle = request.idle_timeout_s or limits.idle_timeout_s
        if idle > limits.max_idle_timeout_s:
            raise field_error(["idle_timeout_s"], idle, f"must be <= {limits.max_idle_timeout_s} (max_idle_timeout_s)")
        checkpoint = None
        if request.from_checkpoint is not None:
            checkpoint = self.checkpoints.loadable_state(request.from_checkpoint, request.with_optimizer,
                                                         ["from_checkpoint"])
        lora = session_lora(request, checkpoint, self.cfg, self.model_path)
        kind, limit = ("full", limits.max_sessions) if lora is None else ("lora", limits.max_lora_sessions)
        open_now = sum(1 for s in self.sessions.values() if (s.lora is None) == (lora is None)) + self.creating[kind]
        if open_now >= limit:
            raise ServiceError(429, f"{open_now} {'LoRA' if lora else 'full-model'} sessions open: the server allows "
                                    f"{'max_lora_sessions' if lora else 'max_sessions'}={limit}; unload one or "
                                    "retry later")
        session_id = session_id or f"s-{secrets.token_hex(6)}"
        self.creating[kind] += 1
        try:
            if lora is None:
                trainer = await self.trainers.full_model()
            else:
                seed = self.cfg.seed if request.lora is None or request.lora.seed is None else request.lora.seed
                trainer = await self.trainers.with_adapter(session_id, lora, seed)
            session = Session(session_id, self.model_path, trainer, Sequencer(session_id, limits.sequence_gap_timeout_s),
                              idle, limits.call_timeout_s, metadata=request.metadata,
                              lora=None if lora is None else asdict(lora))
            if checkpoint is not None:
                try:
                    state = await session.call("load_state", checkpoint.path, request.with_optimizer)
                except Exception:
                    await self.trainers.release(session)
                    raise
                session.step, session.loaded_from = int(state["step"]), checkpoint.checkpoint_id
            self.sessions[session_id] = session
        finally:
            self.creating[kind] -= 1
        logger.info("session %s created%s", session_id, "" if lora is None else f" (LoRA rank {lora.rank})")
        return session.info()

    async def unload(self, session_id: str, reason: str = "unloaded by the client") -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            self.get(session_id)  # raises the 404
            return
        self.ended[session_id] = reason
        await session.sequencer.close(f"session {session_id!r} was unloaded: {reason}")
        await self.trainers.release(session)

    def start_reaper(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap())

    async def watch(self) -> None:
        """Returns (or raises) only if the reaper ends."""
        await asyncio.shield(self._reaper)

    async def close(self, reason: str) -> None:
        """Stop the reaper and unload every session."""
        if self._reaper is not None:
            self._reaper.cancel()
        for session_id in list(self.sessions):
            with contextlib.suppress(Exception):
                await self.unload(session_id, reason)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for session in list(self.sessions.values()):
                if session.idle_for() > session.idle_timeout_s:
                    logger.warning("session %s idle for %.1fs: unloading", session.session_id, session.idle_for())
                    with contextlib.suppress(Exception):
                        await self.unload(session.session_id, f"no request or heartbeat for {session.idle_timeout_s}s "
                                                              "(idle_timeout_s)")

    # -- requests in seq_id order --------------------------------------------------------------------
    def refuse(self, body: Any, error: ServiceError) -> None:
        """A sequenced request was refused (4xx) before it was queued: if it names a session and a seq_id, that
        seq_id gives up its place, so the session's later requests do not wait for it."""
        if not isinstance(body, dict):
            return
        session = self.sessions.get(body.get("model_id") or body.get("session_id"))
        seq_id = body.get("seq_id")
        if session is not None and type(seq_id) is int and seq_id >= 0:
            session.sequencer.refuse(seq_id, refusal_summary(error))

    async def run_in_order(self, request: SequencedRequest, kind: str, execute: Execute,
                           check: Callable[[], Any] = lambda: None, *, chunk_index: int = 0, num_chunks: int = 1,
                           signature: Any = None) -> Any:
        """Queue the request in its session's seq_id order and wait for its result. `check()` is the request's own
        validation (raising ServiceError 4xx) and returns the part the request carries."""
        session = self.get(request.model_id)
        try:
            if num_chunks > self.cfg.sessions.max_chunks:
                raise field_error(["num_chunks"], num_chunks, f"must be <= max_chunks={self.cfg.sessions.max_chunks}")
            part = check()
        except ServiceError as error:
            self.refuse({"model_id": request.model_id, "seq_id": request.seq_id}, error)
            raise
        submitted = session.sequencer.submit(request.seq_id, kind, lambda seq, parts: execute(session, seq, parts),
                                             part, chunk_index=chunk_index, num_chunks=num_chunks, signature=signature)
        if not submitted.complete:
            return ChunkAccepted(model_id=session.session_id, seq_id=submitted.seq_id,
                                 chunks_received=submitted.chunks_received, num_chunks=num_chunks)
        # No timeout of its own: the sequencer answers every queued request (each run is bounded by
        # call_timeout_s, each gap by sequence_gap_timeout_s).
        with session.in_use():
            return await asyncio.shield(submitted.future)


def refusal_summary(error: ServiceError) -> str:
    """One line saying why a request was refused (for the requests that were waiting on its seq_id)."""
    detail = error.detail
    if isinstance(detail, list):
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail[:3]
                           if isinstance(d, dict))
    text = f"{error.status}: {detail}"
    return text if len(text) <= 300 else text[:297] + "..."
