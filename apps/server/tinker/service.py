"""The Tinker protocol over the training service: what the unmodified `tinker` SDK asks, answered by the same parts
forge's own protocol uses (SessionRegistry, Training, Checkpointing, Sampler in runtime.py). Requests and replies
are the SDK's own types (`tinker.types`), binary bodies are wire.py's, and every training and sampling call is
a future (futures.py).

How Tinker's objects map onto forge's:
- a Tinker session (create_session, heartbeats, finish) groups a client's models and sampling sessions;
- a model (create_model, or load_weights that creates one) is one forge session, named `{session}:train:{n}` as
  the SDK derives it; its requests carry seq_id 1, 2, ... which run in that order (forge's seq_id = Tinker's - 1);
- save_weights / load_weights are save_state / load_state, at `tinker://{model}/weights/{name}`;
- save_weights_for_sampler exports the adapter, at `tinker://{model}/sampler_weights/{name}`; a sampling session
  samples with such an adapter, or with the base model on the generators.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
from tinker import types

from actors.lora_config import LORA_TARGETS, local_hf_config
from apps.http.errors import ServiceError
from apps.server.schemas import (
    CreateSessionRequest,
    LoadStateRequest,
    LoRASpec,
    SampleRequest,
    SaveStateRequest,
    SaveWeightsRequest,
    SequencedRequest,
)
from apps.server.tinker.batches import tinker_batch
from apps.server.tinker.futures import FutureStore
from apps.server.tinker.wire import WireForwardBackward, WireSequence, encode_forward_backward_output, \
    encode_sample_response
from forge.actor import rank0
from losses.tinker import TINKER_LOSS_CONFIG, TINKER_LOSSES
from rl.sampling import SamplingParams

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_TINKER_PATH = re.compile(r"^tinker://(?P<model>[^/]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")


@dataclass
class SamplingSession:
    sampler_id: str
    base_model: str
    model_path: str | None  # the tinker:// path it samples with (None: the base model)
    checkpoint_id: str | None  # forge's name of that sampler checkpoint
    clients: int = 1  # join_sampling_session's counter


@dataclass
class TinkerSession:
    session_id: str
    tags: list[str]
    metadata: dict[str, Any]
    created: float = field(default_factory=time.time)
    models: list[str] = field(default_factory=list)
    samplers: int = 0  # sampling sessions made, for their ids


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def _checkpoint_name(model_id: str, name: str) -> str:
    """forge's checkpoint id for a Tinker checkpoint name of a model (ids are global, names per model)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model_id}.{name}")


def _user(message: str) -> ServiceError:
    return ServiceError(400, message)


class TinkerService:
    def __init__(self, service: Any) -> None:  # the TrainingService (runtime.py)
        self.service = service
        cfg = service.cfg.tinker
        self.futures = FutureStore(cfg.retrieve_hold_s, cfg.result_keep_s)
        self.sessions: dict[str, TinkerSession] = {}
        self.finished: set[str] = set()
        self.samplers: dict[str, SamplingSession] = {}
        self.telemetry_events = 0

    # -- sessions --------------------------------------------------------------------------------------
    def create_session(self, request: types.CreateSessionRequest) -> types.CreateSessionResponse:
        session_id = f"ts-{secrets.token_hex(6)}"
        self.sessions[session_id] = TinkerSession(session_id, list(request.tags), dict(request.user_metadata or {}))
        return types.CreateSessionResponse(session_id=session_id)

    def session(self, session_id: str) -> TinkerSession:
        """The live session; 410 (Gone: the SDK stops heartbeating) once finished, 404 if never created."""
        if session_id in self.finished:
            raise ServiceError(410, f"session {session_id!r} has finished")
        if session_id not in self.sessions:
            raise ServiceError(404, f"session {session_id!r}: no such session on this server")
        return self.sessions[session_id]

    def heartbeat(self, session_id: str) -> types.SessionHeartbeatResponse:
        for model_id in self.session(session_id).models:  # a heartbeat keeps the session's models loaded
            if model_id in self.service.sessions:
                self.service.sessions[model_id].touch()
        return types.SessionHeartbeatResponse()

    async def finish(self, session_id: str) -> dict[str, str]:
        session = self.session(session_id)
        self.futures.cancel_owned_by(session_id)
        for model_id in session.models:
            if model_id in self.service.sessions:
                await self.service.unload(model_id, f"Tinker session {session_id} finished")
        del self.sessions[session_id]
        self.finished.add(session_id)
        return {"session_id": session_id, "status": "finished"}

    def _owner(self, model_id: str) -> str | None:
        return model_id.split(":train:")[0] if ":train:" in model_id else None

    def submit(self, work: Any, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        request_id = self.futures.submit(work, owner=None if model_id is None else self._owner(model_id))
        return {"request_id": request_id, "model_id": model_id, **extra}

    # -- models ----------------------------------------------------------------------------------------
    def _lora_spec(self, config: types.LoraConfig) -> LoRASpec:
        family = self.service.cfg.trainer.family
        allowed = LORA_TARGETS.get(family, ())
        targets = [*(_ATTENTION if config.train_attn else ()), *(_MLP if config.train_mlp else ())]
        tied = (local_hf_config(self.service.model_path) or {}).get("tie_word_embeddings")
        if config.train_unembed and "lm_head" in allowed and not tied:  # a tied head is the embedding: not adapted
            targets.append("lm_head")
        targets = [t for t in targets if t in allowed]
        if not targets:
            raise _user("lora_config: train_attn, train_mlp and train_unembed leave no layer to adapt")
        return LoRASpec(rank=config.rank, seed=config.seed, target_modules=targets)

    def create_model(self, request: types.CreateModelRequest) -> dict[str, Any]:
        session = self.session(request.session_id)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"

        async def work() -> types.CreateModelResponse:
            lora = None if request.lora_config is None else self._lora_spec(request.lora_config)
            await self.service.create_session(CreateSessionRequest(base_model=request.base_model, lora=lora,
                                                                   metadata=dict(request.user_metadata or {})),
                                              session_id=model_id)
            session.models.append(model_id)
            return types.CreateModelResponse(model_id=model_id)

        return self.submit(work(), model_id)

    def get_info(self, model_id: str) -> types.GetInfoResponse:
        session = self.service.session(model_id)
        name = self.service.model_path  # a local checkpoint folder: what AutoTokenizer loads in get_tokenizer()
        return types.GetInfoResponse(
            model_id=model_id, model_name=name, is_lora=session.lora is not None,
            lora_rank=None if session.lora is None else session.lora["rank"],
            model_data=types.ModelData(arch=self.service.cfg.trainer.family, model_name=name, tokenizer_id=name))

    # -- training --------------------------------------------------------------------------------------
    def forward_backward(self, wire: WireForwardBackward) -> dict[str, Any]:
        def build() -> Any:
            """The batch, checked: a request at fault is the client's error (400), named by field."""
            if wire.loss_fn not in TINKER_LOSSES:
                raise _user(f"loss_fn={wire.loss_fn!r}: not served here; this server runs "
                            f"{', '.join(TINKER_LOSSES)}")
            allowed = TINKER_LOSS_CONFIG[wire.loss_fn]
            for key, value in wire.loss_fn_config.items():
                if key not in allowed or isinstance(value, str):
                    raise _user(f"loss_fn_config[{key!r}]={value!r}: loss {wire.loss_fn!r} takes "
                                f"{list(allowed) or 'no config'} (numbers)")
            model = self.service.model
            batch = tinker_batch(wire.data, wire.loss_fn, pad_id=model.pad_id, vocab_size=model.vocab_size,
                                 max_len=model.max_model_len)
            try:  # the loss on this batch's own sampling log-probs: a datum it cannot run on is the client's fault
                TINKER_LOSSES[wire.loss_fn](batch.behaviour_logprobs, batch, **wire.loss_fn_config)
            except (ValueError, TypeError) as error:
                raise _user(f"loss_fn={wire.loss_fn!r} cannot run on this request: {error}") from None
            return batch

        async def work() -> bytes:
            endpoint = "forward" if wire.forward_only else "forward_backward"
            batch, out = await self.service.training.run_batch(
                wire.model_id, self._seq(wire.seq_id), endpoint, build, f"losses.tinker:{wire.loss_fn}",
                wire.loss_fn_config, 1.0)
            lengths = [len(d.tokens) for d in wire.data]
            return encode_forward_backward_output(_per_datum(out["logprobs"], batch, lengths, wire.loss_fn),
                                                  _metrics(out))

        self._model(wire.model_id)
        self._seq(wire.seq_id)
        return self.submit(work(), wire.model_id)

    def _model(self, model_id: str) -> Any:
        """The forge session of `model_id`; 404 when it does not exist (the SDK raises NotFoundError)."""
        return self.service.session(model_id)

    def _refusing(self, model_id: str, seq_id: int | None, check: Any) -> Any:
        """`check()`; when it refuses the request (a ServiceError), the request's seq_id gives up its place, so
        the model's later requests do not wait for it."""
        try:
            return check()
        except ServiceError as error:
            self.service.refuse({"model_id": model_id, "seq_id": self._seq(seq_id)}, error)
            raise

    @staticmethod
    def _seq(seq_id: int | None) -> int | None:
        if seq_id is None:
            return None
        if seq_id < 1:
            raise _user(f"seq_id={seq_id}: a model's requests are numbered from 1")
        return seq_id - 1

    def optim_step(self, request: types.OptimStepRequest) -> dict[str, Any]:
        params = request.optim_params

        def check() -> None:
            if not isinstance(params, types.AdamParams):
                raise _user(f"optim_params.type={getattr(params, 'type', None)!r}: this server's optimizer is "
                            "AdamW (adam_params)")

        self._model(request.model_id)
        self._refusing(request.model_id, request.seq_id, check)

        async def work() -> types.OptimStepResponse:
            async def execute(session: Any, seq_id: int, parts: list) -> types.OptimStepResponse:
                # grad_clip_norm 0 means no clipping: an infinite bound scales nothing and still reports the norm.
                clip = float("inf") if params.grad_clip_norm <= 0 else params.grad_clip_norm
                out = await session.call("optim_step", params.learning_rate, (params.beta1, params.beta2), params.eps,
                                         params.weight_decay, clip)
                session.step = int(out["step"])
                return types.OptimStepResponse(metrics={"grad_norm:mean": out["grad_norm"],
                                                        "learning_rate:mean": out["lr"],
                                                        "step:max": float(out["step"])})

            return await self.service.registry.run_in_order(
                SequencedRequest(model_id=request.model_id, seq_id=self._seq(request.seq_id)), "optim_step", execute)

        return self.submit(work(), request.model_id)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_weights(self, request: types.SaveWeightsRequest) -> dict[str, Any]:
        self._model(request.model_id)
        name = request.path or f"step-{secrets.token_hex(4)}"

        async def work() -> types.SaveWeightsResponse:
            await self.service.save_state(SaveStateRequest(model_id=request.model_id, seq_id=self._seq(request.seq_id),
                                                           path=_checkpoint_name(request.model_id, name)))
            return types.SaveWeightsResponse(path=tinker_path(request.model_id, "weights", name))

        return self.submit(work(), request.model_id)

    def _state_checkpoint(self, path: str) -> str:
        parsed = _TINKER_PATH.match(path)
        if parsed is None or parsed["kind"] != "weights":
            raise _user(f"path={path!r}: must be a tinker://<model_id>/weights/<name> path of save_state")
        return _checkpoint_name(parsed["model"], parsed["name"])

    def load_weights(self, request: types.LoadWeightsRequest) -> dict[str, Any]:
        if request.session_id is not None:  # create a model from the checkpoint
            session = self.session(request.session_id)
            model_id = f"{request.session_id}:train:{request.model_seq_id}"

            async def create() -> types.LoadWeightsResponse:
                checkpoint = self._state_checkpoint(request.path)
                await self.service.create_session(CreateSessionRequest(
                    base_model=request.base_model, from_checkpoint=checkpoint, with_optimizer=request.optimizer,
                    metadata=dict(request.user_metadata or {})), session_id=model_id)
                session.models.append(model_id)
                return types.LoadWeightsResponse(path=request.path, model_id=model_id)

            return self.submit(create(), model_id)
        if request.model_id is None:
            raise _user("load_weights: give session_id and model_seq_id (a new model) or model_id and seq_id")
        self._model(request.model_id)

        async def load() -> types.LoadWeightsResponse:
            checkpoint = self._refusing(request.model_id, request.seq_id, lambda: self._state_checkpoint(request.path))
            await self.service.load_state(LoadStateRequest(
                model_id=request.model_id, seq_id=self._seq(request.seq_id), path=checkpoint,
                with_optimizer=request.optimizer))
            return types.LoadWeightsResponse(path=request.path, model_id=request.model_id)

        return self.submit(load(), request.model_id)

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        model = self._model(request.model_id)

        def check() -> None:
            if model.lora is None:
                raise _user(f"model_id={request.model_id!r} is a full-model session: sampling with its weights goes "
                            "through forge's own sync_inference_weights (docs/serving.md); Tinker's sampler weights "
                            "are served for LoRA models")

        self._refusing(request.model_id, request.seq_id, check)
        name = request.path or f"sampler-{secrets.token_hex(4)}"

        async def work() -> types.SaveWeightsForSamplerResponseInternal:
            checkpoint = _checkpoint_name(request.model_id, name)
            await self.service.save_weights_for_sampler(SaveWeightsRequest(
                model_id=request.model_id, seq_id=self._seq(request.seq_id), path=checkpoint))
            path = tinker_path(request.model_id, "sampler_weights", name)
            if request.path is not None:
                return types.SaveWeightsForSamplerResponseInternal(path=path)
            sampler = self._new_sampler(self._owner(request.model_id), path, checkpoint)
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler.sampler_id)

        return self.submit(work(), request.model_id)

    # -- sampling --------------------------------------------------------------------------------------
    def _new_sampler(self, session_id: str | None, model_path: str | None, checkpoint: str | None) -> SamplingSession:
        session = self.sessions.get(session_id) if session_id else None
        number = 0
        if session is not None:
            number, session.samplers = session.samplers, session.samplers + 1
        sampler_id = f"{session_id or 'anon'}:sample:{number}:{secrets.token_hex(3)}"
        sampler = SamplingSession(sampler_id, self.service.model_path, model_path, checkpoint)
        self.samplers[sampler_id] = sampler
        return sampler

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest) -> types.CreateSamplingSessionResponse:
        self.session(request.session_id)
        checkpoint = None
        if request.model_path is not None:
            parsed = _TINKER_PATH.match(request.model_path)
            if parsed is None or parsed["kind"] != "sampler_weights":
                raise _user(f"model_path={request.model_path!r}: must be a tinker://<model_id>/sampler_weights/<name> "
                            "path of save_weights_for_sampler")
            checkpoint = _checkpoint_name(parsed["model"], parsed["name"])
            self.service.checkpoints.sampler_adapter(checkpoint)  # 404 now for an unknown checkpoint
        elif request.base_model is not None:
            if request.base_model not in self.service.registry.served_names():
                raise _user(f"base_model={request.base_model!r}: this server serves {self.service.model_path!r}")
        return types.CreateSamplingSessionResponse(
            sampling_session_id=self._new_sampler(request.session_id, request.model_path, checkpoint).sampler_id)

    def sampler(self, sampler_id: str) -> SamplingSession:
        if sampler_id not in self.samplers:
            raise ServiceError(404, f"sampling session {sampler_id!r}: no such sampler on this server")
        return self.samplers[sampler_id]

    def get_sampler(self, sampler_id: str) -> types.GetSamplerResponse:
        sampler = self.sampler(sampler_id)
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.base_model,
                                        model_path=sampler.model_path)

    def join_sampling_session(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.sampler(sampler_id)
        sampler.clients += 1
        return {"type": "join_sampling_session", "client_counter": sampler.clients - 1}

    def asample(self, request: types.SampleRequest) -> dict[str, Any]:
        if request.sampling_session_id is not None:
            sampler = self.sampler(request.sampling_session_id)
        else:  # a one-off sample named by model_path / base_model
            sampler = self.samplers.get(request.model_path or "") or SamplingSession(
                "", self.service.model_path, request.model_path,
                None if request.model_path is None else self._sampler_checkpoint(request.model_path))
        params = request.sampling_params
        prompt = [t for chunk in request.prompt.chunks for t in getattr(chunk, "tokens", [])]
        if len(prompt) != request.prompt.length:
            raise _user("prompt: only encoded-text chunks are accepted by this server's model")
        stop_strings, stop_tokens = _stops(params.stop)
        try:
            forge_params = SamplingParams(n=request.num_samples, max_tokens=params.max_tokens or 16,
                                          temperature=params.temperature, top_p=params.top_p,
                                          top_k=0 if params.top_k in (-1, 0) else params.top_k,
                                          stop_token_ids=stop_tokens, seed=params.seed)
        except ValueError as error:
            raise _user(f"sampling_params: {error}") from None
        ids = [f"{request.sampling_session_id or 'sample'}:{secrets.token_hex(4)}:{i}"
               for i in range(request.num_samples)]

        async def work() -> bytes:
            out = await self.service.sample(SampleRequest(model_path=sampler.checkpoint_id, prompts=[prompt],
                                                          sampling_params=forge_params))
            sequences = [_cut_at_stop(s, stop_strings, self.service.model.tokenizer) for s in out.samples[0]]
            prompt_logprobs = await self._prompt_logprobs(sampler, prompt) if request.prompt_logprobs else None
            return encode_sample_response(sequences, prompt_logprobs)

        return self.submit(work(), None, sample_sequence_ids=ids)

    def _sampler_checkpoint(self, model_path: str) -> str:
        parsed = _TINKER_PATH.match(model_path)
        if parsed is None or parsed["kind"] != "sampler_weights":
            raise _user(f"model_path={model_path!r}: must be a tinker://<model_id>/sampler_weights/<name> path")
        return _checkpoint_name(parsed["model"], parsed["name"])

    async def _prompt_logprobs(self, sampler: SamplingSession, prompt: list[int]) -> list[float | None]:
        """None for the first token (nothing precedes it), then each token's log-prob given those before it."""
        if len(prompt) < 2:
            return [None] * len(prompt)
        if sampler.checkpoint_id is None:
            scored, _ = await self.service.generators.score.route(prompt[:1], prompt[1:], self.service.policy.version)
        else:
            adapter = self.service.checkpoints.sampler_adapter(sampler.checkpoint_id)
            trainer = await self.service.trainers.shared_lora()
            scored = rank0(await trainer.score_prompt.call(adapter.path, prompt))
        return [None, *scored]

    # -- training runs and checkpoints -----------------------------------------------------------------
    def _checkpoints_of(self, model_id: str) -> list[types.Checkpoint]:
        prefix = _checkpoint_name(model_id, "")
        out = []
        for info in self.service.checkpoints.list():
            if not info.checkpoint_id.startswith(prefix):
                continue
            name = info.checkpoint_id[len(prefix):]
            kind = "weights" if info.checkpoint_type == "state" else "sampler_weights"
            out.append(types.Checkpoint(checkpoint_id=f"{kind}/{name}",
                                        checkpoint_type="training" if kind == "weights" else "sampler",
                                        time=datetime.fromtimestamp(info.created_at, timezone.utc),
                                        tinker_path=tinker_path(model_id, kind, name), size_bytes=info.size_bytes))
        return out

    def checkpoints(self, model_id: str) -> types.CheckpointsListResponse:
        return types.CheckpointsListResponse(checkpoints=self._checkpoints_of(model_id))

    def training_run(self, model_id: str) -> types.TrainingRun:
        session = self.service.session(model_id)
        checkpoints = self._checkpoints_of(model_id)
        last = {kind: max((c for c in checkpoints if c.checkpoint_type == kind), key=lambda c: c.time, default=None)
                for kind in ("training", "sampler")}
        return types.TrainingRun(training_run_id=model_id, base_model=session.base_model, model_owner="local",
                                 is_lora=session.lora is not None,
                                 lora_rank=None if session.lora is None else session.lora["rank"],
                                 last_request_time=datetime.fromtimestamp(session.last_seen, timezone.utc),
                                 last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"])

    def training_runs(self, limit: int, offset: int) -> types.TrainingRunsResponse:
        ids = [m for s in self.sessions.values() for m in s.models if m in self.service.sessions]
        runs = [self.training_run(m) for m in ids[offset: offset + limit]]
        return types.TrainingRunsResponse(training_runs=runs,
                                          cursor=types.Cursor(offset=offset, limit=limit, total_count=len(ids)))


def _stops(stop: Any) -> tuple[list[str], list[int]]:
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [stop], []
    stop = list(stop)
    if all(isinstance(s, str) for s in stop):
        return stop, []
    if all(isinstance(s, int) for s in stop):
        return [], stop
    raise _user("sampling_params.stop: give strings or token ids, not both")


def _cut_at_stop(sample: Any, stop_strings: list[str], tokenizer: Any) -> WireSequence:
    """The sample up to and including the token that completes the first stop string (if one occurs)."""
    tokens, logprobs = list(sample.tokens), list(sample.logprobs)
    if stop_strings:
        for n in range(1, len(tokens) + 1):
            text = tokenizer.decode(tokens[:n])
            if any(s in text for s in stop_strings):
                return WireSequence(tokens[:n], logprobs[:n], True)
    return WireSequence(tokens, logprobs, sample.finish_reason == "stop")


def _per_datum(logprobs: Any, batch: Any, lengths: list[int], loss: str) -> list[dict[str, np.ndarray]]:
    """Each datum's target log-probs (N values: its input's length) and, for cross_entropy, its per-token loss."""
    rows = logprobs.float().numpy()
    weights = batch.response_mask.numpy()
    out = []
    for i, n in enumerate(lengths):
        datum = {"logprobs": rows[i, :n]}
        if loss == "cross_entropy":
            datum["elementwise_loss"] = -(rows[i, :n] * weights[i, :n])
        out.append(datum)
    return out


def _metrics(out: dict[str, Any]) -> dict[str, float]:
    """Tinker's `name:reduction` metrics: the loss's own (already so named) and the loss as loss:sum."""
    metrics = {k: float(v) for k, v in out["metrics"].items() if ":" in k}
    metrics.setdefault("loss:sum", float(out["loss"]))
    return metrics
