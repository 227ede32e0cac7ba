"""Request and response bodies of the gateway: the OpenAI chat-completions subset it serves, and the /rl API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from rl.types import Episode


# --- OpenAI chat completions ------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type in ("text", "input_text"))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with the usage and no choices


class ChatCompletionRequest(BaseModel):
    """Fields the gateway does not use are accepted and ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="one choice per request (each is one recorded interaction)")
    stream: bool = False  # server-sent events (OpenAI's chat.completion.chunk objects), ending with [DONE]
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0: the sampled token's log-prob is returned")

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, value: Any) -> Any:
        if value:
            raise ValueError("stop sequences are not supported (recorded tokens must be what was sampled); "
                             "use max_tokens")
        return None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ForgeInteraction(BaseModel):
    """forge's extension of the response: what was recorded for training."""

    session_id: str
    interaction_id: str
    policy_versions: list[int]
    trainable: bool


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str
    forge: ForgeInteraction


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; the last one with choices carries forge's record."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str
    usage: Usage | None = None
    forge: ForgeInteraction | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "forge"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- /rl --------------------------------------------------------------------------------------------
class StartSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
                                description="becomes the session id (default: a generated one)")
    api_key: str | None = Field(None, min_length=8, max_length=256,
                                description="a previous session's key: that session is ended and exported, and the "
                                            "new one keeps the key (refresh)")
    refresh: bool = Field(True, description="false: 409 instead of refreshing when api_key is bound to a session")
    timeout_seconds: float | None = Field(None, gt=0, description="idle timeout (default rl.session_timeout_s)")


class StartSessionResponse(BaseModel):
    session_id: str
    api_key: str
    policy_version: int
    ended_session: str | None = Field(None, description="the session a refresh ended and exported")


class SetRewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float
    interaction_id: str | None = Field(None, description="the chat completion's id; default the last interaction")

    @model_validator(mode="after")
    def _finite(self) -> SetRewardRequest:
        if self.reward != self.reward or abs(self.reward) == float("inf"):
            raise ValueError(f"reward={self.reward}: must be a finite number")
        return self


class SetRewardResponse(BaseModel):
    session_id: str
    interaction_id: str
    reward: float


class EndSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Answer with the exported episodes' tokens (to inspect or train elsewhere); the replay buffer gets them anyway.
    return_episodes: bool = False


class ExportedEpisode(BaseModel):
    """One conversation as the trainer gets it: the first prompt, then every later token in order, with the mask
    (1: the model's sampled tokens, 0: messages and template tokens), behaviour log-probs and policy versions."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    behaviour_logprobs: list[float]
    policy_versions: list[int]
    reward: float

    @classmethod
    def of(cls, episode: Episode) -> ExportedEpisode:
        return cls(prompt_ids=episode.prompt_ids, completion_ids=episode.completion_ids,
                   completion_mask=episode.completion_mask, behaviour_logprobs=episode.behaviour_logprobs,
                   policy_versions=episode.policy_versions, reward=episode.reward)


class EndSessionResponse(BaseModel):
    session_id: str
    interactions: int
    exported_episodes: int  # one per conversation with trainable tokens
    # requests whose prompt did not continue the previous request's exact tokens: each started a new episode
    history_breaks: int
    reason: str
    episodes: list[ExportedEpisode] | None = None  # with return_episodes


class GatewayStats(BaseModel):
    policy_version: int
    train_steps: int
    active_sessions: int
    capacity: int
    used_capacity: int
    sessions_started: int
    sessions_ended: dict[str, int]
    interactions: int
    exported_trajectories: int
    exported_episodes: int
    skipped_interactions: int
    history_breaks: int
    export_failures: int
    trained_episodes: int
    buffer: dict[str, int]
    last_train_metrics: dict[str, float]


class GatewayHealth(BaseModel):
    status: Literal["ok"]
    policy_version: int
    active_sessions: int
    generator_replicas_healthy: int
    train_steps: int


# --- errors -----------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the gateway answers (OpenAI's shape; see apps/gateway/errors.py)."""

    error: ErrorDetail
