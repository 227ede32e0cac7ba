"""The training service's state and operations: the generator service, the sessions (a full-model session
has a trainer actor mesh of its own; every LoRA session is an adapter on the one shared LoRA trainer), the
checkpoint catalogue and the policy version counter. The HTTP layer (app.py) only translates requests into
these calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from actors.generator import Generator
from actors.lora_config import LORA_TARGETS, LoRAConfig, check_lora_for_model, local_hf_config
from apps.server.batches import batch_temperature, build_batch, check_loss, check_loss_inputs, concat_batches
from apps.server.checkpoints import CheckpointStore
from apps.server.config import ServerConfig
from apps.server.errors import ServiceError, field_error, not_found
from apps.server.model import tokenizer_info
from apps.server.schemas import (
    ChunkAccepted,
    CheckpointResponse,
    CreateSessionRequest,
    ForwardBackwardRequest,
    ForwardBackwardResponse,
    ForwardRequest,
    HealthResponse,
    LoadStateRequest,
    LoadStateResponse,
    LoRASpec,
    LossFnOutput,
    OptimStepRequest,
    OptimStepResponse,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SaveStateRequest,
    SaveWeightsRequest,
    SequencedRequest,
    ServerInfo,
    SessionInfo,
    SyncWeightsRequest,
    SyncWeightsResponse,
)
from apps.server.sequencer import Sequencer
from apps.server.sessions import Session
from apps.server.lora_trainer import LoRATrainerActor
from apps.server.training_actor import ServerTrainerActor
from forge.actor import EndpointError, rank0
from forge.provisioner import get_provisioner
from forge.service import NoHealthyReplicaError
from losses import LOSSES

logger = logging.getLogger(__name__)
WEIGHTS = "policy"



def endpoint_failure(error: EndpointError) -> ServiceError:
    """An actor endpoint's exception as an HTTP error: always the server's failure (500, with the cause).
    A request's own faults are found before it reaches an actor (schemas, `batches`, the checks below) and
    answered 4xx there; what an actor raises (CUDA out of memory, a broken checkpoint file) is not the
    client's to fix."""
    head = str(error).split("\n--- remote traceback", 1)[0]
    return ServiceError(500, f"server-side failure: {head}")


def refusal_summary(error: ServiceError) -> str:
    """One line saying why a request was refused (for the requests that were waiting on its seq_id)."""
    detail = error.detail
    if isinstance(detail, list):
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail[:3]
                           if isinstance(d, dict))
    text = f"{error.status}: {detail}"
    return text if len(text) <= 300 else text[:297] + "..."


class TrainingService:
    def __init__(self, cfg: ServerConfig, model_path: str, warm_start_accuracy: float | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.warm_start_accuracy = warm_start_accuracy
        info = tokenizer_info(model_path)
        self.tokenizer = info["tokenizer"]
        self.pad_id, self.eos_id = info["pad_id"], info["eos_id"]
        self.vocab_size, self.max_model_len = info["vocab_size"], info["max_model_len"]
        self.checkpoints = CheckpointStore(Path(cfg.run_dir) / "checkpoints")
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # session id -> why it is gone
        self.creating = {"full": 0, "lora": 0}
        self.lora_trainer: Any = None  # every LoRA session's adapter, over one base (started by the first)
        self._lora_start = asyncio.Lock()
        # forge.compat, 14: Monarch 0.1.2's host agent can fail on a message to a proc mesh stopped mid-run,
        # taking every process down. So the trainer actors of unloaded sessions are kept for the next session
        # (reset to the served weights by `_trainer_for`) rather than stopped; meshes are stopped only at
        # shutdown, as in apps.grpo.
        self.idle_trainers: list[Any] = []
        self.version = 0  # the generators serve the base weights as version 0 until the first sync
        self._publish_lock = asyncio.Lock()
        self.started_at = time.time()
        self.generators: Any = None
        self._reaper: asyncio.Task | None = None
        self._background: set[asyncio.Future] = set()  # clean-ups nobody waits for (held so they are not collected)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        await get_provisioner().start_weight_store()
        generator_cfg = replace(self.cfg.generator, model=self.model_path, weight_namespace=WEIGHTS)
        self.generators = await Generator.options(num_replicas=self.cfg.generator_replicas,
                                                  mesh_name="generator").as_service(generator_cfg)
        self._reaper = asyncio.ensure_future(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for session_id in list(self.sessions):
            with contextlib.suppress(Exception):
                await self.unload(session_id, "the server is shutting down")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for session in list(self.sessions.values()):
                if session.idle_for() > session.idle_timeout_s:
                    logger.warning("session %s idle for %.1fs: unloading", session.session_id, session.idle_for())
                    with contextlib.suppress(Exception):
                        await self.unload(session.session_id, f"no request or heartbeat for {session.idle_timeout_s}s "
                                                              "(idle_timeout_s)")

    # -- service -------------------------------------------------------------------------------------
    def health(self) -> HealthResponse:
        healthy = len(self.generators.healthy_replicas()) if self.generators is not None else 0
        return HealthResponse(status="ok", model=self.model_path, policy_version=self.version,
                              sessions=len(self.sessions), max_sessions=self.cfg.sessions.max_sessions,
                              generator_replicas_healthy=healthy, uptime_s=time.time() - self.started_at)

    def info(self) -> ServerInfo:
        return ServerInfo(model=self.model_path, pad_id=self.pad_id, eos_id=self.eos_id, vocab_size=self.vocab_size,
                          max_model_len=self.max_model_len, policy_version=self.version, loss_fns=list(LOSSES),
                          warm_start_accuracy=self.warm_start_accuracy)

    # -- sessions ------------------------------------------------------------------------------------
    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.ended:
                raise ServiceError(404, f"session {session_id!r} was unloaded: {self.ended[session_id]}")
            raise not_found("session", session_id, list(self.sessions))
        session.touch()
        return session

    def _served_names(self) -> list[str]:
        names = [self.model_path, str(Path(self.model_path).resolve())]
        configured = self.cfg.model
        names += [configured, str(Path(configured).resolve())] if configured else []
        if Path(configured).name == "tiny-qwen3":
            names.append("tiny")
        return names

    async def create_session(self, request: CreateSessionRequest) -> SessionInfo:
        limits = self.cfg.sessions
        if request.base_model is not None and request.base_model not in self._served_names():
            raise field_error(["base_model"], request.base_model,
                              f"this server trains only {self.model_path!r} (or 'tiny' / the configured model "
                              f"{self.cfg.model!r}); omit base_model to use it")
        idle = request.idle_timeout_s or limits.idle_timeout_s
        if idle > limits.max_idle_timeout_s:
            raise field_error(["idle_timeout_s"], idle, f"must be <= {limits.max_idle_timeout_s} (max_idle_timeout_s)")
        checkpoint = None
        if request.from_checkpoint is not None:
            checkpoint = self._loadable(request.from_checkpoint, request.with_optimizer, ["from_checkpoint"])
        lora = self._session_lora(request, checkpoint)
        if lora is not None and self.cfg.trainer.activation_checkpoint != "none":
            # actors.lora.init_adapters matches parameters by name, which a checkpointed block's wrapper changes: an
            # adapter added to the built model would keep peft's own draw, not its seed's.
            raise field_error(["lora"], request.lora and request.lora.model_dump(), "LoRA sessions need the server's "
                              f"trainer.activation_checkpoint='none' (it is {self.cfg.trainer.activation_checkpoint!r})")
        kind, limit = ("full", limits.max_sessions) if lora is None else ("lora", limits.max_lora_sessions)
        open_now = sum(1 for s in self.sessions.values() if (s.lora is None) == (lora is None)) + self.creating[kind]
        if open_now >= limit:
            raise ServiceError(429, f"{open_now} {'LoRA' if lora else 'full-model'} sessions open: the server allows "
                                    f"{'max_lora_sessions' if lora else 'max_sessions'}={limit}; unload one or "
                                    "retry later")
        session_id = f"s-{secrets.token_hex(6)}"
        self.creating[kind] += 1
        try:
            if lora is None:
                trainer = await self._trainer_for(session_id)
            else:
                seed = self.cfg.seed if request.lora is None or request.lora.seed is None else request.lora.seed
                trainer = await self._adapter_for(session_id, lora, seed)
            session = Session(session_id, self.model_path, trainer, Sequencer(session_id, limits.sequence_gap_timeout_s),
                              idle, metadata=request.metadata, lora=None if lora is None else asdict(lora))
            if checkpoint is not None:
                try:
                    state = await self._call(session, "load_state", checkpoint.path, request.with_optimizer)
                except Exception:
                    await self._release(session)
                    raise
                session.step, session.loaded_from = int(state["step"]), checkpoint.checkpoint_id
            self.sessions[session_id] = session
        finally:
            self.creating[kind] -= 1
        logger.info("session %s created%s", session_id, "" if lora is None else f" (LoRA rank {lora.rank})")
        return session.info()

    def _session_lora(self, request: CreateSessionRequest, checkpoint: Any) -> LoRAConfig | None:
        """The new session's adapter: the request's `lora`, or a LoRA checkpoint's own; checked against the model
        (a 422 naming the field: lora.rank, lora.target_modules, ...)."""
        if request.lora is None:
            return None if checkpoint is None or checkpoint.lora is None else LoRAConfig(**checkpoint.lora)
        if checkpoint is not None and checkpoint.lora is None:
            raise field_error(["from_checkpoint"], checkpoint.checkpoint_id,
                              "is a full-model checkpoint; a LoRA session starts from a LoRA session's save_state")
        lora = self._lora_config(request.lora)
        if checkpoint is not None and not same_adapter(asdict(lora), checkpoint.lora):
            raise field_error(["lora"], request.lora.model_dump(), f"checkpoint {checkpoint.checkpoint_id!r} holds "
                              f"an adapter {adapter_summary(checkpoint.lora)}; omit lora to take the checkpoint's")
        return lora

    def _lora_config(self, spec: LoRASpec) -> LoRAConfig:
        family = self.cfg.trainer.family
        targets = spec.target_modules or [m for m in LORA_TARGETS.get(family, ()) if m != "lm_head"]
        try:
            lora = LoRAConfig(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=targets)
            check_lora_for_model(lora, family, local_hf_config(self.model_path), field_prefix="lora")
        except ValueError as error:
            named = re.match(r"(?:lora|LoRAConfig)\.(\w+)=", str(error))  # the field the check names
            field = named[1] if named else None
            value = getattr(spec, field, None) if field else spec.model_dump()
            raise field_error(["lora", field] if field else ["lora"], value, str(error)) from None
        return lora

    async def _shared_lora_trainer(self) -> Any:
        """The one trainer of every LoRA session, started by the first one (or by sampling with an adapter saved
        by an earlier run of the server). Kept until the server stops, like the full sessions' trainers."""
        limits = self.cfg.sessions
        async with self._lora_start:
            if self.lora_trainer is None:
                trainer_cfg = replace(self.cfg.trainer, model_path=self.model_path, lora=None)
                spawn = LoRATrainerActor.options(procs=1, mesh_name="lora-trainer").as_actor(
                    trainer_cfg, sampler_seed=self.cfg.seed, max_sampler_adapters=limits.max_lora_sessions)
                try:
                    self.lora_trainer = await asyncio.wait_for(spawn, limits.spawn_timeout_s)
                except asyncio.TimeoutError:
                    raise ServiceError(504, f"the LoRA trainer did not start within spawn_timeout_s="
                                            f"{limits.spawn_timeout_s}s") from None
        return self.lora_trainer

    async def _adapter_for(self, session_id: str, lora: LoRAConfig, seed: int) -> Any:
        """The shared LoRA trainer with a new adapter (and optimizer) for this session."""
        trainer = await self._shared_lora_trainer()
        timeout = self.cfg.sessions.call_timeout_s
        try:
            await asyncio.wait_for(trainer.add_session.call(session_id, asdict(lora), seed), timeout)
        except asyncio.TimeoutError:
            # The add still runs later (the trainer takes its calls one at a time, in order): remove what it adds,
            # or the adapter would hold memory with no session to use or count it.
            removal = asyncio.ensure_future(self._remove_adapter(trainer, session_id))
            self._background.add(removal)
            removal.add_done_callback(self._background.discard)
            raise ServiceError(504, f"adding the adapter took longer than call_timeout_s={timeout}s") from None
        except EndpointError as e:
            raise endpoint_failure(e) from None
        return trainer

    async def _trainer_for(self, session_id: str) -> Any:
        """A trainer with the served model's weights: an idle one reset (see COMPAT in __init__), else a new mesh."""
        limits = self.cfg.sessions
        if self.idle_trainers:
            trainer = self.idle_trainers.pop()
            try:
                await asyncio.wait_for(trainer.reset.call(), limits.spawn_timeout_s)
                return trainer
            except asyncio.TimeoutError:
                raise ServiceError(504, f"resetting a trainer took longer than spawn_timeout_s={limits.spawn_timeout_s}s") from None
            except EndpointError as e:
                raise endpoint_failure(e) from None
        trainer_cfg = replace(self.cfg.trainer, model_path=self.model_path)
        spawn = ServerTrainerActor.options(procs=limits.trainer_procs, mesh_name="session-trainer").as_actor(
            trainer_cfg, weight_namespace=WEIGHTS)
        try:
            return await asyncio.wait_for(spawn, limits.spawn_timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(504, f"the session's trainer did not start within spawn_timeout_s="
                                    f"{limits.spawn_timeout_s}s") from None

    async def unload(self, session_id: str, reason: str = "unloaded by the client") -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            self.session(session_id)  # raises the 404
            return
        self.ended[session_id] = reason
        await session.sequencer.close(f"session {session_id!r} was unloaded: {reason}")
        await self._release(session)

    async def _release(self, session: Session) -> None:
        """A full session's trainer is kept, reset when the next session takes it; a LoRA session's adapter and
        optimizer state are deleted from the shared trainer."""
        if session.lora is None:
            self.idle_trainers.append(session.trainer)
            return
        await self._remove_adapter(session.trainer, session.session_id)

    async def _remove_adapter(self, trainer: Any, session_id: str) -> None:
        try:
            await asyncio.wait_for(trainer.remove_session.call(session_id), self.cfg.sessions.call_timeout_s)
        except (asyncio.TimeoutError, EndpointError) as error:
            logger.warning("removing the adapter of session %s failed: %s", session_id, error)

    # -- calls into a session's trainer --------------------------------------------------------------
    async def _call(self, session: Session, endpoint: str, *args: Any) -> Any:
        timeout = self.cfg.sessions.call_timeout_s
        if session.lora is not None:  # the shared LoRA trainer's endpoints name the session's adapter first
            args = (session.session_id, *args)
        session.busy += 1
        try:
            return rank0(await asyncio.wait_for(getattr(session.trainer, endpoint).call(*args), timeout))
        except asyncio.TimeoutError:
            raise ServiceError(504, f"{endpoint} did not finish within call_timeout_s={timeout}s") from None
        except EndpointError as e:
            raise endpoint_failure(e) from None
        finally:
            session.busy -= 1
            session.touch()

    def refuse(self, body: Any, error: ServiceError) -> None:
        """A sequenced request was refused (4xx) before it was queued: if it names a session and a seq_id, that
        seq_id gives up its place, so the session's later requests do not wait for it."""
        if not isinstance(body, dict):
            return
        session = self.sessions.get(body.get("model_id") or body.get("session_id"))
        seq_id = body.get("seq_id")
        if session is not None and type(seq_id) is int and seq_id >= 0:
            session.sequencer.refuse(seq_id, refusal_summary(error))

    async def _sequenced(self, request: SequencedRequest, kind: str, execute: Callable[[Session, int, list], Awaitable[Any]],
                         check: Callable[[], Any] = lambda: None, *, chunk_index: int = 0, num_chunks: int = 1,
                         signature: Any = None) -> Any:
        """Queue the request in its session's seq_id order and wait for its result. `check()` is the request's own
        validation (raising ServiceError 4xx) and returns the part the request carries."""
        session = self.session(request.model_id)
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
        session.busy += 1
        try:
            return await asyncio.shield(submitted.future)
        finally:
            session.busy -= 1
            session.touch()

    # -- training ------------------------------------------------------------------------------------
    def _batch_part(self, request: ForwardRequest | ForwardBackwardRequest, loss: str | None) -> tuple:
        """The request's batch (checked datum by datum), its sequence lengths and the temperature its log-probs are
        at; with a loss, the loss's name and parameters are checked on this batch too."""
        if loss is not None:
            check_loss(loss, request.loss_fn_params, allow_custom=False)
        batch = build_batch(request.data, pad_id=self.pad_id, vocab_size=self.vocab_size, max_len=self.max_model_len,
                            needs_rl_inputs=loss is not None)
        if loss is not None:
            check_loss_inputs(loss, request.loss_fn_params, batch)
        temperature = batch_temperature(request.data, self.cfg.trainer.temperature)
        return batch, [len(d.model_input.tokens()) for d in request.data], temperature

    async def _run_batch(self, session: Session, seq_id: int, parts: list, endpoint: str, loss: str | None,
                         loss_params: dict) -> ForwardBackwardResponse:
        """`endpoint` (forward_backward or forward) of the session's trainer on the request's chunks as one batch,
        scored at the temperature its log-probs are at."""
        temperatures = {p[2] for p in parts}
        if len(temperatures) > 1:
            raise ServiceError(422, f"loss_fn_inputs.temperature: the chunks of one request are at temperatures "
                                    f"{sorted(temperatures)}; give one temperature in every chunk")
        batch = concat_batches([p[0] for p in parts], self.pad_id)
        lengths = [n for p in parts for n in p[1]]
        out = await self._call(session, endpoint, batch, loss, dict(loss_params), temperatures.pop())
        return ForwardBackwardResponse(model_id=session.session_id, seq_id=seq_id, num_datums=len(lengths),
                                       loss=out["loss"], metrics=out["metrics"],
                                       loss_fn_outputs=_per_datum(out["logprobs"], lengths))

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        async def execute(session: Session, seq_id: int, parts: list) -> ForwardBackwardResponse:
            return await self._run_batch(session, seq_id, parts, "forward_backward", request.loss_fn,
                                         request.loss_fn_params)

        signature = ("forward_backward", request.loss_fn, json.dumps(request.loss_fn_params, sort_keys=True))
        return await self._sequenced(request, "forward_backward", execute, lambda: self._batch_part(request, request.loss_fn),
                                     chunk_index=request.chunk_index, num_chunks=request.num_chunks, signature=signature)

    async def forward(self, request: ForwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        async def execute(session: Session, seq_id: int, parts: list) -> ForwardBackwardResponse:
            return await self._run_batch(session, seq_id, parts, "forward", request.loss_fn, request.loss_fn_params)

        signature = ("forward", request.loss_fn, json.dumps(request.loss_fn_params, sort_keys=True))
        return await self._sequenced(request, "forward", execute, lambda: self._batch_part(request, request.loss_fn),
                                     chunk_index=request.chunk_index, num_chunks=request.num_chunks, signature=signature)

    async def optim_step(self, request: OptimStepRequest) -> OptimStepResponse:
        adam = request.adam_params

        async def execute(session: Session, seq_id: int, parts: list) -> OptimStepResponse:
            out = await self._call(session, "optim_step", adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                   adam.weight_decay, adam.grad_clip_norm)
            session.step = int(out["step"])
            return OptimStepResponse(model_id=session.session_id, seq_id=seq_id, step=session.step,
                                     grad_norm=out["grad_norm"], learning_rate=out["lr"],
                                     accumulated_batches=int(out["accumulated_batches"]))

        return await self._sequenced(request, "optim_step", execute)

    # -- checkpoints and weights ---------------------------------------------------------------------
    def _loadable(self, name: str, with_optimizer: bool, loc: list, session: Session | None = None) -> Any:
        """A save_state checkpoint `session` can load (any session: one being created)."""
        info = self.checkpoints.get(name)  # 404 when unknown
        if info.checkpoint_type != "state":
            raise field_error(loc, name, "is a save_weights_for_sampler export; load_state takes save_state checkpoints")
        if with_optimizer and not info.with_optimizer:
            raise field_error(["with_optimizer"], True, f"checkpoint {name!r} was saved without the optimizer; "
                                                        "load it with with_optimizer=false")
        if session is not None and not same_adapter(session.lora, info.lora):
            raise field_error(loc, name, f"holds {adapter_summary(info.lora)}; session {session.session_id!r} trains "
                                         f"{adapter_summary(session.lora)}")
        return info

    async def save_state(self, request: SaveStateRequest) -> CheckpointResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> CheckpointResponse:
            out = await self._call(session, "save_state", str(parts[0]), request.with_optimizer)
            info = self.checkpoints.record(request.path, "state", session.session_id, int(out["step"]),
                                           request.with_optimizer, session.lora)
            return CheckpointResponse(model_id=session.session_id, seq_id=seq_id, checkpoint=info)

        return await self._sequenced(request, "save_state", execute, lambda: self.checkpoints.path_for(request.path))

    async def load_state(self, request: LoadStateRequest) -> LoadStateResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> LoadStateResponse:
            info = parts[0]
            out = await self._call(session, "load_state", info.path, request.with_optimizer)
            session.step = int(out["step"])
            return LoadStateResponse(model_id=session.session_id, seq_id=seq_id, checkpoint_id=info.checkpoint_id,
                                     with_optimizer=request.with_optimizer, step=session.step)

        return await self._sequenced(request, "load_state", execute, lambda: self._loadable(
            request.path, request.with_optimizer, ["path"], self.session(request.model_id)))

    async def save_weights_for_sampler(self, request: SaveWeightsRequest) -> CheckpointResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> CheckpointResponse:
            await self._call(session, "export_hf", str(parts[0]))
            info = self.checkpoints.record(request.path, "sampler", session.session_id, session.step, False, session.lora)
            return CheckpointResponse(model_id=session.session_id, seq_id=seq_id, checkpoint=info)

        return await self._sequenced(request, "save_weights_for_sampler", execute,
                                     lambda: self.checkpoints.path_for(request.path))

    async def sync_inference_weights(self, request: SyncWeightsRequest) -> SyncWeightsResponse:
        async def execute(session: Session, seq_id: int, parts: list) -> SyncWeightsResponse:
            async with self._publish_lock:  # versions reach the generators in order
                version = self.version + 1
                await self._call(session, "publish_as", version)
                self.version = version
                try:
                    versions = await asyncio.wait_for(self.generators.update_weights.fanout(version),
                                                      self.cfg.sessions.call_timeout_s)
                except asyncio.TimeoutError:
                    raise ServiceError(504, f"generators did not load policy version {version} in time") from None
                except EndpointError as e:
                    raise endpoint_failure(e) from None
            return SyncWeightsResponse(model_id=session.session_id, seq_id=seq_id, policy_version=version,
                                       generator_versions=list(versions))

        def check() -> None:
            if self.session(request.model_id).lora is not None:
                raise field_error(["model_id"], request.model_id, "is a LoRA session: its adapter is not published to "
                                  "the shared generators; save_weights_for_sampler(name), then sample with "
                                  "model_path=<that checkpoint>")

        return await self._sequenced(request, "sync_inference_weights", execute, check)

    # -- sampling ------------------------------------------------------------------------------------
    def _prompt_ids(self, request: SampleRequest) -> list[list[int]]:
        """Every prompt as token ids, checked against the vocabulary and the model window (a 422 naming the prompt)."""
        prompts = []
        for i, prompt in enumerate(request.all_prompts()):
            loc = ["prompt"] if request.prompts is None else ["prompts", i]
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise field_error(loc, prompt, "empty: a prompt needs at least one token")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise field_error(loc, ids[:8], f"token ids must be in [0, {self.vocab_size})")
            if len(ids) >= self.max_model_len:
                raise field_error(loc, f"{len(ids)} tokens", f"the model's window is {self.max_model_len} tokens: at "
                                                            f"most {self.max_model_len - 1} prompt tokens leave room to generate")
            prompts.append(ids)
        return prompts

    def _adapter_checkpoint(self, model_path: str) -> Any:
        """The LoRA sampler checkpoint `model_path` names (its name or its path)."""
        name = Path(model_path).name
        known = {c.checkpoint_id: c for c in self.checkpoints.list()}
        info = known.get(name)
        if info is None or (name != model_path and Path(model_path).resolve() != Path(info.path)):
            raise ServiceError(404, [{"loc": ["body", "model_path"], "input": model_path, "type": "not_found",
                                      "msg": f"no checkpoint {model_path!r}; known: {', '.join(sorted(known)) or 'none'}"}])
        if info.checkpoint_type != "sampler" or info.lora is None:
            kind = "a save_state checkpoint" if info.checkpoint_type == "state" else "a full-model export"
            raise field_error(["model_path"], model_path, f"is {kind}; model_path takes a LoRA session's "
                                                          "save_weights_for_sampler checkpoint")
        return info

    async def sample(self, request: SampleRequest) -> SampleResponse:
        params = replace(request.sampling_params, n=request.count())
        prompts = self._prompt_ids(request)
        timeout = self.cfg.sessions.call_timeout_s
        adapter = None if request.model_path is None else self._adapter_checkpoint(request.model_path)
        try:
            if adapter is None:
                outputs = await asyncio.wait_for(self.generators.generate_batch.route(prompts, params), timeout)
            else:
                trainer = await self._shared_lora_trainer()
                outputs = rank0(await asyncio.wait_for(trainer.sample.call(adapter.path, prompts, params), timeout))
        except asyncio.TimeoutError:
            raise ServiceError(504, f"sampling did not finish within call_timeout_s={timeout}s") from None
        except EndpointError as e:
            raise endpoint_failure(e) from None
        except NoHealthyReplicaError as e:
            raise ServiceError(503, str(e)) from None
        outputs = list(outputs)  # a generator's CompletionBatch unpacked once: each prompt's completions
        temperature = params.temperature or 1.0  # the engines score greedy tokens at temperature 1
        versions = [v for out in outputs for c in out for v in c.policy_versions]
        return SampleResponse(
            policy_version=0 if adapter is not None else max(versions) if versions else self.version,
            model_path=None if adapter is None else adapter.checkpoint_id,
            prompt_tokens=[out[0].prompt_ids if out else [] for out in outputs],
            samples=[[SampledSequence(tokens=c.token_ids, logprobs=c.logprobs, text=c.text,
                                      finish_reason=c.finish_reason, policy_versions=c.policy_versions,
                                      kept_token_ids=kept_lists(c.kept_token_ids), temperature=temperature)
                      for c in out]
                     for out in outputs])

def kept_lists(kept: Any) -> list[list[int]] | None:
    """A completion's kept sets ([tokens, K] int32, -1 padded; None: the full vocabulary) as one list of token ids
    per generated token."""
    return None if kept is None else [[t for t in row if t >= 0] for row in kept.tolist()]


def same_adapter(a: dict | None, b: dict | None) -> bool:
    """Whether two sessions' adapters have the same shape and scale (dropout aside): a checkpoint of one loads
    into the other."""
    if a is None or b is None:
        return a is None and b is None
    return (a["rank"], a["alpha"], sorted(a["target_modules"])) == (b["rank"], b["alpha"], sorted(b["target_modules"]))


def adapter_summary(lora: dict | None) -> str:
    if lora is None:
        return "full-model weights"
    return f"a LoRA adapter (rank {lora['rank']}, alpha {lora['alpha']}, target_modules {lora['target_modules']})"


def _per_datum(logprobs: Any, lengths: list[int]) -> list[LossFnOutput]:
    rows = logprobs.tolist()
    return [LossFnOutput(logprobs=row[: n - 1]) for row, n in zip(rows, lengths)]
