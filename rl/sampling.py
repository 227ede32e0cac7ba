"""How to sample a completion: the one definition shared by the generator engines, the apps, the REST
server's request schema and the HTTP client SDK (`apps.server.client`).

Plain Python on purpose (no torch, no Monarch): the client SDK imports it, and the REST server uses the
dataclass as a pydantic field, so these checks are also the server's 422 messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The most tokens a truncated sampling step may keep. The kept set of every generated token travels with the
# rollout to the trainer (which must renormalise over exactly that set), so it is bounded: a top_k above this is
# refused, and top_p without top_k samples from at most this many of the most likely tokens (as if
# top_k=MAX_KEPT_TOKENS), so the recorded set is always complete and the replay exact.
MAX_KEPT_TOKENS = 64


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # < 1: the smallest set of the most likely tokens holding top_p of the mass (after top_k)
    top_k: int = 0  # 0: no top-k; at most MAX_KEPT_TOKENS
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be >= 0 (0 = no top-k)")
        if self.top_k > MAX_KEPT_TOKENS:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be <= {MAX_KEPT_TOKENS} (rl.sampling."
                             "MAX_KEPT_TOKENS): every token's kept set travels to the trainer, which replays it")

    @property
    def truncates(self) -> bool:
        """Whether sampling draws from a truncated, renormalised distribution (top-k or top-p, not greedy)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    @property
    def kept_width(self) -> int:
        """The most tokens one sampling step keeps when `truncates`."""
        return self.top_k or MAX_KEPT_TOKENS
