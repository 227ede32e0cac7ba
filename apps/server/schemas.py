"""Every request and response body of the training service, as pydantic models (they make the OpenAPI schema).

Tinker-style aliases are accepted where the Tinker protocol uses other names: `session_id` for `model_id`,
`loss_fn_config` for `loss_fn_params`, `model_input.chunks[].tokens` for `model_input.input_ids`,
`labels` for `target_tokens`, `weights` for `mask`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from rl.sampling import SamplingParams

SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
CheckpointName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class _Strict(BaseModel):
    """Unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _model_id() -> Any:
    return Field(validation_alias=AliasChoices("model_id", "session_id"),
                 description="the session (Tinker clients may send it as session_id)")


class SessionRequest(_Strict):
    model_id: SessionId = _model_id()


class SequencedRequest(SessionRequest):
    seq_id: int | None = Field(None, ge=0, description="execution order within the session; None: after every "
                               "request already received")


# --- sessions ---------------------------------------------------------------------------------------
class LoRASpec(_Strict):
    """A LoRA session's adapter (peft's names for the target modules, e.g. q_proj, v_proj)."""

    rank: int = Field(16, ge=1, description="the adapter's rank; at most the model's hidden size")
    alpha: float = Field(32.0, gt=0, description="the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(None, min_length=1, description="the adapted linear layers "
                                             "(default: every linear layer of the blocks)")
    seed: int | None = Field(None, description="the adapter's initialization (default: the server's seed)")


class CreateSessionRequest(_Strict):
    base_model: str | None = Field(None, description="must name the served model (or be omitted)")
    lora: LoRASpec | None = Field(None, description="train a LoRA adapter over the server's shared base model "
                                  "(None: a full-model session with a trainer of its own)")
    from_checkpoint: CheckpointName | None = Field(
        None, validation_alias=AliasChoices("from_checkpoint", "checkpoint_id"),
        description="start from a save_state checkpoint instead of the base weights")
    with_optimizer: bool = Field(True, description="with from_checkpoint: also restore the optimizer state")
    idle_timeout_s: float | None = Field(None, gt=0, description="unload after this long without a request or "
                                         "heartbeat (default: the server's sessions.idle_timeout_s)")
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionInfo(BaseModel):
    session_id: str
    model_id: str
    base_model: str
    created_at: float
    last_seen: float
    idle_timeout_s: float
    next_seq_id: int
    step: int
    loaded_from: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    lora: dict[str, Any] | None = Field(None, description="the adapter's rank, alpha, dropout, target_modules")


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class HeartbeatResponse(BaseModel):
    session_id: str
    expires_in_s: float


class UnloadResponse(BaseModel):
    session_id: str
    unloaded: bool


# --- training data ----------------------------------------------------------------------------------
class EncodedChunk(_Strict):
    tokens: list[int] = Field(min_length=1)
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(_Strict):
    input_ids: list[int] | None = Field(None, description="the full sequence: prompt + completion")
    chunks: list[EncodedChunk] | None = Field(None, description="Tinker form: concatenated chunks' tokens")

    @model_validator(mode="after")
    def _one_form(self) -> ModelInput:
        if (self.input_ids is None) == (self.chunks is None):
            raise ValueError("give exactly one of input_ids or chunks")
        return self

    def tokens(self) -> list[int]:
        if self.input_ids is not None:
            return list(self.input_ids)
        return [t for chunk in self.chunks or [] for t in chunk.tokens]


class LossFnInputs(_Strict):
    """Per-token lists have length len(input_ids) - 1: position t is about predicting input_ids[t + 1]."""

    logprobs: list[float] | None = Field(None, description="behaviour (sampling) log-probs; 0 off the completion")
    advantages: float | list[float] | None = Field(
        None, description="one number per sequence, or per token (0 on prompt positions; constant on the mask)")
    mask: list[float] | None = Field(None, validation_alias=AliasChoices("mask", "weights"),
                                     description="1 on trained positions (default: where per-token advantages != 0)")
    target_tokens: list[int] | None = Field(None, validation_alias=AliasChoices("target_tokens", "labels"),
                                            description="optional check: must equal input_ids[1:]")
    policy_versions: list[int] | None = Field(
        None, description="per position, the policy version that sampled input_ids[t + 1] (a sample's own "
        "policy_versions; -1 where none did, e.g. the prompt). None: 0 everywhere")
    ref_logprobs: list[float] | None = None
    kept_token_ids: list[list[int]] | None = Field(
        None, description="per position, the token ids the top_k/top_p sampling step that drew input_ids[t + 1] "
        "kept (a sample's own kept_token_ids; [] where it sampled the full vocabulary, e.g. the prompt): the trainer "
        "renormalises over them, so its log-probs are of the distribution the tokens were drawn from")
    temperature: float | None = Field(
        None, gt=0, description="the sampling temperature `logprobs` are at (a sample's own `temperature`): the "
        "trainer scores the datum at it, so its log-probs are of the distribution the tokens were drawn from. None: "
        "the server's trainer.temperature. One temperature per request (the trainer scores a batch at one)")
    reward: float = 0.0


class Datum(_Strict):
    model_input: ModelInput
    loss_fn_inputs: LossFnInputs = Field(default_factory=LossFnInputs)


LossParams = dict[str, float | int | str | bool | None]


class ChunkedRequest(SequencedRequest):
    data: list[Datum] = Field(min_length=1)
    chunk_index: int = Field(0, ge=0, description="this part of a batch sent in num_chunks requests")
    num_chunks: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _chunk_in_range(self) -> ChunkedRequest:
        if self.chunk_index >= self.num_chunks:
            raise ValueError(f"chunk_index={self.chunk_index}: must be < num_chunks={self.num_chunks}")
        return self


class ForwardBackwardRequest(ChunkedRequest):
    loss_fn: str = Field("grpo", description="a loss of forge's `losses` (grpo, dapo, gspo, cispo, dr_grpo)")
    loss_fn_params: LossParams = Field(default_factory=dict,
                                       validation_alias=AliasChoices("loss_fn_params", "loss_fn_config"))


class ForwardRequest(ChunkedRequest):
    loss_fn: str | None = Field(None, description="also compute this loss's value (no gradients)")
    loss_fn_params: LossParams = Field(default_factory=dict,
                                       validation_alias=AliasChoices("loss_fn_params", "loss_fn_config"))


class LossFnOutput(BaseModel):
    logprobs: list[float]


class ForwardBackwardResponse(BaseModel):
    model_id: str
    seq_id: int
    num_datums: int
    loss: float | None
    metrics: dict[str, float]
    loss_fn_outputs: list[LossFnOutput]


class ChunkAccepted(BaseModel):
    model_id: str
    seq_id: int
    status: Literal["accepted"] = "accepted"
    chunks_received: int
    num_chunks: int


# --- optimizer --------------------------------------------------------------------------------------
class AdamParams(_Strict):
    learning_rate: float = Field(1e-4, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float | None = Field(None, gt=0, description="None: the trainer's max_grad_norm")


class OptimStepRequest(SequencedRequest):
    adam_params: AdamParams = Field(default_factory=AdamParams)


class OptimStepResponse(BaseModel):
    model_id: str
    seq_id: int
    step: int
    grad_norm: float
    learning_rate: float
    accumulated_batches: int


# --- checkpoints and weights ------------------------------------------------------------------------
class SaveStateRequest(SequencedRequest):
    path: CheckpointName = Field(validation_alias=AliasChoices("path", "name", "checkpoint_id"),
                                 description="the checkpoint's name (its id)")
    with_optimizer: bool = True


class LoadStateRequest(SequencedRequest):
    path: CheckpointName = Field(validation_alias=AliasChoices("path", "name", "checkpoint_id"))
    with_optimizer: bool = True


class SaveWeightsRequest(SequencedRequest):
    path: CheckpointName = Field(validation_alias=AliasChoices("path", "name", "checkpoint_id"))


class CheckpointInfo(BaseModel):
    checkpoint_id: str
    checkpoint_type: Literal["state", "sampler"]
    path: str
    session_id: str
    step: int
    with_optimizer: bool
    created_at: float
    size_bytes: int
    lora: dict[str, Any] | None = Field(None, description="saved by a LoRA session: its adapter's settings")


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointInfo]


class CheckpointResponse(BaseModel):
    model_id: str
    seq_id: int
    checkpoint: CheckpointInfo


class LoadStateResponse(BaseModel):
    model_id: str
    seq_id: int
    checkpoint_id: str
    with_optimizer: bool
    step: int


class DeleteCheckpointResponse(BaseModel):
    checkpoint_id: str
    deleted: bool


class SyncWeightsRequest(SequencedRequest):
    pass


class SyncWeightsResponse(BaseModel):
    model_id: str
    seq_id: int
    policy_version: int
    generator_versions: list[int]


# --- sampling ---------------------------------------------------------------------------------------
Prompt = str | list[int]
MAX_SAMPLES = 256  # completions per prompt in one request


class SampleRequest(_Strict):
    model_path: str | None = Field(None, description="a LoRA session's save_weights_for_sampler checkpoint (its name "
                                   "or path): sample with that adapter; None: the generators' current policy")
    prompt: Prompt | None = Field(None, description="one prompt: text or token ids")
    prompts: list[Prompt] | None = Field(None, min_length=1, max_length=1024, description="several prompts")
    num_samples: int | None = Field(None, ge=1, le=MAX_SAMPLES,
                                    description="completions per prompt (default: sampling_params.n)")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams,
                                            description="rl.sampling.SamplingParams (its checks are these 422s)")

    @model_validator(mode="after")
    def _one_form(self) -> SampleRequest:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of prompt or prompts")
        n = self.sampling_params.n
        if self.num_samples is not None and n not in (1, self.num_samples):
            raise ValueError(f"num_samples={self.num_samples} and sampling_params.n={n}: give the count once "
                             "(or the same in both)")
        if self.count() > MAX_SAMPLES:
            raise ValueError(f"sampling_params.n={n}: must be <= {MAX_SAMPLES}")
        return self

    def count(self) -> int:
        return self.num_samples if self.num_samples is not None else self.sampling_params.n

    def all_prompts(self) -> list[Prompt]:
        return [self.prompt] if self.prompts is None else list(self.prompts)


class SampledSequence(BaseModel):
    tokens: list[int]
    logprobs: list[float] = Field(description="of the distribution each token was drawn from: with top_k/top_p, "
                                  "renormalised over that step's kept tokens")
    text: str
    finish_reason: str
    policy_versions: list[int]
    kept_token_ids: list[list[int]] | None = Field(
        None, description="with top_k/top_p: per token, the token ids its sampling step kept (None: the full "
        "vocabulary). Train on the sample with them as loss_fn_inputs.kept_token_ids (apps.server.client.Datum.from_sample "
        "does), or the trainer's log-probs are of another distribution than `logprobs`")
    temperature: float = Field(
        description="the temperature `logprobs` are at: the request's sampling temperature (greedy, 0, is scored at "
        "1). Train on the sample with it as loss_fn_inputs.temperature (apps.server.client.Datum.from_sample does), or the "
        "trainer scores it at its own trainer.temperature")


class SampleResponse(BaseModel):
    policy_version: int = Field(description="the generators' policy version (0 for samples of a LoRA adapter)")
    model_path: str | None = Field(None, description="the adapter sampled with, when the request named one")
    prompt_tokens: list[list[int]]
    samples: list[list[SampledSequence]] = Field(description="samples[i]: num_samples sequences of prompt i")


# --- service ----------------------------------------------------------------------------------------
class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    policy_version: int
    sessions: int
    max_sessions: int
    generator_replicas_healthy: int
    uptime_s: float


class ServerInfo(BaseModel):
    model: str
    pad_id: int
    eos_id: int | None
    vocab_size: int
    max_model_len: int
    policy_version: int
    loss_fns: list[str]
    warm_start_accuracy: float | None = None


class MemoryResponse(BaseModel):
    processes: dict[str, int] = Field(description="resident bytes of the server process (controller) and of each "
                                      "actor process, by mesh name and rank")


class ErrorResponse(BaseModel):
    detail: Any
