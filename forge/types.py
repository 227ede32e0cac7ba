"""Data types shared by the generator, the replay buffer, the trainer and the losses.

Token-aligned tensors in a `TrainBatch` follow one convention: position t holds the quantity for
*predicting* token t+1 of `input_ids`, so they have length T-1 for a sequence of T tokens. A loss
therefore needs only `log_softmax(logits[:, :-1]).gather(input_ids[:, 1:])`.

Kept sets. With top-k / top-p the behaviour policy is the truncated, renormalised distribution; each generated
token then carries the ids of the tokens its sampling step kept (`kept_token_ids`: int32, one row per token,
padded with -1; at most `forge.sampling.MAX_KEPT_TOKENS` per row) and the trainer renormalises over exactly
those (`actors.logprobs.token_logprobs`). A row of only -1 means the full vocabulary; None means that everywhere.

Multi-turn episodes. An episode of several turns keeps the exact token sequence the model saw and produced:
`prompt_ids` is the first prompt, `completion_ids` everything after it (the model's tokens and, between its turns,
the environment's observation tokens, appended by id). `completion_mask` is 1 on the model's tokens and 0 on the
environment's; those carry log-prob 0 and policy version -1, and `TrainBatch.response_mask` is 0 there, so every
loss scores the model's tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge.sampling import SamplingParams  # noqa: F401  (re-exported: `from forge.types import SamplingParams`)


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    # log pi_behaviour(token) from the raw logits at the sampling temperature, one per generated token.
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    # The policy version whose weights produced each generated token.
    policy_versions: list[int]
    # [len(token_ids), K] int32: the tokens each step kept, -1 padded; None when sampling did not truncate.
    # Left out of `==` (a tensor has no single truth value); compare it with torch.equal.
    kept_token_ids: torch.Tensor | None = field(default=None, compare=False)

    @property
    def oldest_policy_version(self) -> int:
        return min(self.policy_versions) if self.policy_versions else -1


@dataclass
class Episode:
    """A scored completion, as the replay buffer stores it."""

    episode_id: int
    group_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    policy_versions: list[int]
    reward: float
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    # [len(completion_ids), K] int32, -1 padded (see Completion); left out of `==` like there.
    kept_token_ids: torch.Tensor | None = field(default=None, compare=False)
    # Multi-turn: 1 where completion_ids[i] is the model's, 0 where the environment's; None: all the model's.
    completion_mask: list[int] | None = None

    @property
    def oldest_policy_version(self) -> int:
        """The oldest version among the model's tokens (environment tokens carry -1 and no version)."""
        return min((v for v in self.policy_versions if v >= 0), default=-1)

    @classmethod
    def from_completion(
        cls, completion: Completion, *, episode_id: int, group_id: int, reward: float, advantage: float = 0.0
    ) -> Episode:
        return cls(
            episode_id=episode_id,
            group_id=group_id,
            prompt_ids=list(completion.prompt_ids),
            completion_ids=list(completion.token_ids),
            behaviour_logprobs=list(completion.logprobs),
            policy_versions=list(completion.policy_versions),
            reward=reward,
            advantage=advantage,
            kept_token_ids=completion.kept_token_ids,
        )


@dataclass
class TrainBatch:
    """Right-padded tensors for a batch of episodes (see the module docstring for alignment)."""

    input_ids: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, T-1] float, 1 where the target token was generated
    behaviour_logprobs: torch.Tensor  # [B, T-1] float
    policy_versions: torch.Tensor  # [B, T-1] long, -1 off the response
    advantages: torch.Tensor  # [B] float
    rewards: torch.Tensor  # [B] float
    ref_logprobs: torch.Tensor | None = None  # [B, T-1] float
    # [B, T-1, K] int32: the tokens the sampler kept when it drew target t+1, -1 padded (all -1: full vocabulary);
    # None when no episode was sampled with top-k / top-p.
    kept_token_ids: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def oldest_policy_versions(self) -> torch.Tensor:
        """[B] long: each sequence's oldest policy version among the model's tokens, as
        `Episode.oldest_policy_version` (-1 for a sequence with none)."""
        none = torch.iinfo(torch.long).max
        oldest = self.policy_versions.masked_fill(self.policy_versions < 0, none).amin(dim=1)
        return oldest.masked_fill(oldest == none, -1)

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop): micro-batches and data-parallel shards."""
        return TrainBatch(
            input_ids=self.input_ids[start:stop],
            response_mask=self.response_mask[start:stop],
            behaviour_logprobs=self.behaviour_logprobs[start:stop],
            policy_versions=self.policy_versions[start:stop],
            advantages=self.advantages[start:stop],
            rewards=self.rewards[start:stop],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[start:stop],
            kept_token_ids=None if self.kept_token_ids is None else self.kept_token_ids[start:stop],
        )

    @classmethod
    def from_episodes(cls, episodes: list[Episode], pad_id: int) -> TrainBatch:
        if not episodes:
            raise ValueError("TrainBatch.from_episodes: no episodes")
        length = max(len(e.prompt_ids) + len(e.completion_ids) for e in episodes)
        batch = len(episodes)
        input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
        response_mask = torch.zeros(batch, length - 1)
        behaviour = torch.zeros(batch, length - 1)
        versions = torch.full((batch, length - 1), -1, dtype=torch.long)
        has_ref = all(e.ref_logprobs is not None for e in episodes)
        ref = torch.zeros(batch, length - 1) if has_ref else None
        kept = _kept_token_ids(episodes, length - 1)
        for row, e in enumerate(episodes):
            p, c = len(e.prompt_ids), len(e.completion_ids)
            for name in ("behaviour_logprobs", "policy_versions", "completion_mask"):
                values = getattr(e, name)
                if values is not None and len(values) != c:
                    raise ValueError(f"Episode {e.episode_id}: {name} has {len(values)} entries; must have one per "
                                     f"completion token ({c})")
            input_ids[row, : p + c] = torch.tensor(e.prompt_ids + e.completion_ids, dtype=torch.long)
            # Target token p+i (the i-th generated one) is predicted at position p+i-1.
            span = slice(p - 1, p - 1 + c)
            response_mask[row, span] = 1.0 if e.completion_mask is None else torch.tensor(e.completion_mask,
                                                                                         dtype=torch.float32)
            behaviour[row, span] = torch.tensor(e.behaviour_logprobs, dtype=torch.float32)
            versions[row, span] = torch.tensor(e.policy_versions, dtype=torch.long)
            if ref is not None:
                ref[row, span] = torch.tensor(e.ref_logprobs, dtype=torch.float32)
            if kept is not None and e.kept_token_ids is not None:
                kept[row, span, : e.kept_token_ids.shape[1]] = e.kept_token_ids
        return cls(
            input_ids=input_ids,
            response_mask=response_mask,
            behaviour_logprobs=behaviour,
            policy_versions=versions,
            advantages=torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            ref_logprobs=ref,
            kept_token_ids=kept,
        )


def _kept_token_ids(episodes: list[Episode], positions: int) -> torch.Tensor | None:
    """An all -1 [B, positions, K] int32 tensor, K the widest episode's kept set; None if no episode has one."""
    widths = []
    for e in episodes:
        if e.kept_token_ids is None:
            continue
        if e.kept_token_ids.dim() != 2 or e.kept_token_ids.shape[0] != len(e.completion_ids):
            raise ValueError(f"Episode {e.episode_id}: kept_token_ids has shape {tuple(e.kept_token_ids.shape)}; "
                             f"must be [{len(e.completion_ids)}, K] (one row per completion token)")
        widths.append(e.kept_token_ids.shape[1])
    if not widths:
        return None
    return torch.full((len(episodes), positions, max(widths)), -1, dtype=torch.int32)
