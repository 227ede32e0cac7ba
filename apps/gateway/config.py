"""The gateway's configuration: typed sections, validated by `forge.config` before any process starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from actors.generator_config import GeneratorConfig
from actors.replay_buffer_config import ReplayBufferConfig
from actors.trainer_config import TrainerConfig
from apps.warm_start.config import WarmStartConfig


@dataclass
class GatewayHTTPConfig:
    host: str = "127.0.0.1"
    port: int = 8090
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in [0, 65535]")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level={self.log_level!r}: must be one of critical, error, warning, info, debug")


@dataclass
class ChatConfig:
    # How messages become a prompt: "plain" concatenates the message texts (forge's tiny model has no chat
    # template: "12+34=" is a prompt); "template" uses the tokenizer's chat template.
    format: Literal["plain", "template"] = "plain"
    default_max_tokens: int = 16
    max_tokens_limit: int = 1024
    served_model_name: str = "default"  # what /v1/models lists; requests may name any model

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens}: must be in [1, max_tokens_limit="
                             f"{self.max_tokens_limit}]")


@dataclass
class OnlineRLConfig:
    admin_api_key: str = "???"  # protects /rl/start_session and /rl/stats; required
    session_timeout_s: float = 3600.0  # a session idle this long is ended and its trajectory exported
    max_session_timeout_s: float = 86400.0  # the most a start_session request may ask for
    turn_discount: float = 1.0  # an interaction without a reward gets the next one's reward times this
    train: bool = True  # train whenever replay_buffer.batch_size episodes are buffered
    call_timeout_s: float = 120.0  # one generation, one buffer call
    train_timeout_s: float = 600.0  # one training step

    def __post_init__(self) -> None:
        if len(self.admin_api_key) < 8:
            raise ValueError(f"admin_api_key={self.admin_api_key!r}: must be at least 8 characters")
        for name in ("session_timeout_s", "max_session_timeout_s", "call_timeout_s", "train_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        if self.session_timeout_s > self.max_session_timeout_s:
            raise ValueError(f"session_timeout_s={self.session_timeout_s}: must be <= max_session_timeout_s="
                             f"{self.max_session_timeout_s}")
        if not 0 <= self.turn_discount <= 1:
            raise ValueError(f"turn_discount={self.turn_discount}: must be in [0, 1]")


@dataclass
class GatewayConfig:
    generator: GeneratorConfig
    trainer: TrainerConfig
    model: str = "tiny"  # "tiny" (built by forge into model_cache), an HF checkpoint folder, or a hub id
    model_cache: str = ".cache/forge"
    run_dir: str = "runs/gateway"
    seed: int = 0
    generator_replicas: int = 1
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)  # tiny model only (arithmetic)
    http: GatewayHTTPConfig = field(default_factory=GatewayHTTPConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    rl: OnlineRLConfig = field(default_factory=OnlineRLConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)

    def __post_init__(self) -> None:
        if self.generator_replicas < 1:
            raise ValueError(f"generator_replicas={self.generator_replicas}: must be >= 1")
        if self.replay_buffer.batch_size % self.trainer.minibatches:
            raise ValueError(f"replay_buffer.batch_size={self.replay_buffer.batch_size}: must be a multiple of "
                             f"trainer.minibatches={self.trainer.minibatches}")

    @property
    def capacity(self) -> int:
        """Trajectory slots: open sessions plus buffered episodes may not exceed this (the staleness bound)."""
        return self.replay_buffer.batch_size * (self.replay_buffer.max_policy_age + 1)
