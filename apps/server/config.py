"""The training service's configuration: typed sections, validated by `forge.config` before any process starts."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from actors.generator_config import GeneratorConfig
from actors.trainer_config import TrainerConfig
from apps.warm_start.config import WarmStartConfig


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback, reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class HTTPConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication; else every /api/v1 call needs it (Bearer or X-API-Key)
    log_level: str = "warning"  # uvicorn's

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in [0, 65535]")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError(f"api_key={self.api_key!r}: must be None or at least 8 characters")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(f"host={self.host!r} with api_key=None: the training API would be open to anyone who "
                             "reaches that address (it runs code on the server's model); set http.api_key, or "
                             "serve on 127.0.0.1 behind your own proxy")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level={self.log_level!r}: must be one of critical, error, warning, info, debug")


@dataclass
class SessionConfig:
    max_sessions: int = 2  # concurrent full-model sessions (each owns one trainer actor mesh)
    max_lora_sessions: int = 8  # concurrent LoRA sessions (adapters on one shared trainer; as many sampler adapters)
    idle_timeout_s: float = 600.0  # a session with no request or heartbeat for this long is unloaded
    max_idle_timeout_s: float = 86400.0  # the most a create_session request may ask for
    sequence_gap_timeout_s: float = 30.0  # how long requests wait for a missing lower seq_id before failing (409)
    call_timeout_s: float = 600.0  # one actor call (forward_backward, save_state, ...)
    spawn_timeout_s: float = 300.0  # starting a session's trainer
    max_chunks: int = 1024  # chunks one request may be split into
    trainer_procs: int = 1  # data-parallel ranks of each session's trainer

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_lora_sessions", "max_chunks", "trainer_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("idle_timeout_s", "max_idle_timeout_s", "sequence_gap_timeout_s", "call_timeout_s",
                     "spawn_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        if self.idle_timeout_s > self.max_idle_timeout_s:
            raise ValueError(f"idle_timeout_s={self.idle_timeout_s}: must be <= max_idle_timeout_s="
                             f"{self.max_idle_timeout_s}")


@dataclass
class TinkerConfig:
    """The Tinker protocol's futures (apps/server/tinker/futures.py)."""

    retrieve_hold_s: float = 20.0  # a retrieve_future poll waits this long for its result, then answers try_again
    result_keep_s: float = 600.0  # a finished request's result (or error) is kept this long for its poll

    def __post_init__(self) -> None:
        # The SDK gives a poll 45 s before it counts as lost: a hold must end well before that.
        if not 0 < self.retrieve_hold_s <= 30:
            raise ValueError(f"retrieve_hold_s={self.retrieve_hold_s}: must be in (0, 30] (the SDK waits 45 s for "
                             "a poll's answer)")
        if self.result_keep_s <= 0:
            raise ValueError(f"result_keep_s={self.result_keep_s}: must be > 0")


@dataclass
class ServerConfig:
    generator: GeneratorConfig
    trainer: TrainerConfig  # the template of every session's trainer (model_path is the served model)
    model: str = "tiny"  # "tiny" (built by forge into model_cache), an HF checkpoint folder, or a hub id
    model_cache: str = ".cache/forge"
    run_dir: str = "runs/server"  # checkpoints/ (save_state, save_weights_for_sampler) live here
    seed: int = 0
    generator_replicas: int = 1
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)  # tiny model only (arithmetic)
    # The tiny model's task, warm-started: true writes answers least-significant digit first ("12+34=" -> "64"), as
    # configs/grpo_tiny.yaml's task, the order RL learns fast on this model; false: "12+34=" -> "46".
    reverse_answer: bool = False
    http: HTTPConfig = field(default_factory=HTTPConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    tinker: TinkerConfig = field(default_factory=TinkerConfig)

    def __post_init__(self) -> None:
        if self.generator_replicas < 1:
            raise ValueError(f"generator_replicas={self.generator_replicas}: must be >= 1")
