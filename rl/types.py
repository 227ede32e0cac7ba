"""Data types shared by the generator, the replay buffer, the trainer and the losses.

Token-aligned tensors in a `TrainBatch` follow one convention: position t holds the quantity for
*predicting* token t+1 of `input_ids`, so they have length T-1 for a sequence of T tokens. A loss
therefore needs only `log_softmax(logits[:, :-1]).gather(input_ids[:, 1:])`.

Kept sets. With top-k / top-p the behaviour policy is the truncated, renormalised distribution; each generated
token then carries the ids of the tokens its sampling step kept (`kept_token_ids`: int32, one row per token,
padded with -1; at most `rl.sampling.MAX_KEPT_TOKENS` per row) and the trainer renormalises over exactly
those (`actors.logprobs.token_logprobs`). A row of only -1 means the full vocabulary; None means that everywhere.

Multi-turn episodes. An episode of several turns keeps the exact token sequence the model saw and produced:
`prompt_ids` is the first prompt, `completion_ids` everything after it (the model's tokens and, between its turns,
the environment's observation tokens, appended by id). `completion_mask` is 1 on the model's tokens and 0 on the
environment's; those carry log-prob 0 and policy version -1, and `TrainBatch.response_mask` is 0 there, so every
loss scores the model's tokens only.

On the wire. Every actor message pickles its arguments, and a tensor costs far more to pickle than a short list
while one flat tensor per field costs far less than a list per episode (`python -m bench.episode_transport`). So
completions and episodes cross actor boundaries packed: `CompletionBatch` (generator -> its caller),
`EpisodeBatch` (generator or controller -> replay buffer -> reference model) and `TrainBatch` (replay buffer ->
trainer), each a few flat tensors for the whole message. `Completion` and `Episode` are the per-item views of the first two.

A GRPO job's single-turn completions skip the controller: the generator keeps them and answers with their texts
(`KeptCompletions`), the controller scores and selects the groups and sends the replay buffer a `KeptEpisodes` (which
rows of which kept batch, with their ids, rewards and advantages), and the buffer takes those rows' tensors from the
generator replica that keeps them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rl.sampling import SamplingParams  # noqa: F401  (re-exported: `from rl.types import SamplingParams`)


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
    # The teacher's top-K tokens at each completion token's position, [len(completion_ids), K] int32, and their
    # log-probs with the rest of its mass last, [len(completion_ids), K+1] float32 (losses.distill's kl="reverse" or
    # "forward"); left out of `==` like kept_token_ids.
    ref_topk_ids: torch.Tensor | None = field(default=None, compare=False)
    ref_topk_logprobs: torch.Tensor | None = field(default=None, compare=False)
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
class CompletionBatch:
    """The completions of several prompts, packed for the wire ("On the wire" above). It reads like the
    `list[list[Completion]]` it packs (`CompletionBatch.pack`): `len(batch)` prompts, `batch[i]` prompt i's
    completions, `batch[i:j]` the CompletionBatch of prompts i..j-1, and iterating yields each prompt's list."""

    prompt_ids: torch.Tensor  # [sum of prompt lengths] int32: each prompt once, one after another
    prompt_lengths: torch.Tensor  # [P] long
    samples: torch.Tensor  # [P] long: how many completions each prompt has
    token_ids: torch.Tensor  # [sum of completion lengths] int32: prompt by prompt, completion by completion
    lengths: torch.Tensor  # [N] long: each completion's tokens
    logprobs: torch.Tensor  # float32, like token_ids
    policy_versions: torch.Tensor  # int32, like token_ids
    texts: list[str]
    finish_reasons: list[str]
    kept_token_ids: torch.Tensor | None = None  # [sum of completion lengths, K] int32, -1 padded
    kept_widths: torch.Tensor | None = None  # [N] long: each completion's K (0: it sampled the full vocabulary)

    @classmethod
    def pack(cls, groups: Sequence[Sequence[Completion]]) -> CompletionBatch:
        completions = [c for group in groups for c in group]
        prompts = [group[0].prompt_ids if group else [] for group in groups]
        lengths = [len(c.token_ids) for c in completions]
        kept, widths = _pack_kept([c.kept_token_ids for c in completions], lengths,
                                  [f"Completion {i}" for i in range(len(completions))])
        return cls(prompt_ids=_flat(prompts, torch.int32), prompt_lengths=_lengths(prompts),
                   samples=torch.tensor([len(group) for group in groups], dtype=torch.long),
                   token_ids=_flat([c.token_ids for c in completions], torch.int32),
                   lengths=torch.tensor(lengths, dtype=torch.long),
                   logprobs=_flat([c.logprobs for c in completions], torch.float32),
                   policy_versions=_flat([c.policy_versions for c in completions], torch.int32),
                   texts=[c.text for c in completions], finish_reasons=[c.finish_reason for c in completions],
                   kept_token_ids=kept, kept_widths=widths)

    def unpack(self) -> list[list[Completion]]:
        lengths = self.lengths.tolist()
        prompts = _rows(self.prompt_ids, self.prompt_lengths.tolist())
        columns = zip(_rows(self.token_ids, lengths), _rows(self.logprobs, lengths),
                      _rows(self.policy_versions, lengths), _unpack_kept(self.kept_token_ids, self.kept_widths, lengths),
                      self.texts, self.finish_reasons)
        groups = []
        for prompt, count in zip(prompts, self.samples.tolist()):
            groups.append([Completion(prompt_ids=list(prompt), token_ids=ids, text=text, logprobs=logprobs,
                                      finish_reason=finish, policy_versions=versions, kept_token_ids=kept)
                           for ids, logprobs, versions, kept, text, finish in itertools.islice(columns, count)])
        return groups

    def __len__(self) -> int:
        return len(self.samples)

    @functools.cached_property
    def _offsets(self) -> tuple[list[int], list[int], list[int]]:
        """Where each prompt, each prompt's completions and each completion's tokens begin in the flat tensors, as
        lists: an answer for many prompts is sliced once per prompt (a GRPO group: apps/grpo/rollouts.py), and tensor
        arithmetic per slice cost more than the slice."""
        return tuple(list(itertools.accumulate(lengths.tolist(), initial=0))
                     for lengths in (self.prompt_lengths, self.samples, self.lengths))

    def __iter__(self) -> Iterator[list[Completion]]:
        return iter(self.unpack())

    def __getitem__(self, index: int | slice) -> list[Completion] | CompletionBatch:
        if not isinstance(index, slice):
            position = range(len(self))[index]  # negative indices, and IndexError past the end
            return self[position : position + 1].unpack()[0]
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError(f"CompletionBatch[{index}]: only contiguous slices (step 1)")
        stop = max(start, stop)
        prompt_offsets, completion_offsets, token_offsets = self._offsets
        prompts = prompt_offsets[start], prompt_offsets[stop]
        first, last = completion_offsets[start], completion_offsets[stop]
        tokens = token_offsets[first], token_offsets[last]
        return CompletionBatch(
            prompt_ids=self.prompt_ids[slice(*prompts)], prompt_lengths=self.prompt_lengths[start:stop],
            samples=self.samples[start:stop], token_ids=self.token_ids[slice(*tokens)],
            lengths=self.lengths[first:last], logprobs=self.logprobs[slice(*tokens)],
            policy_versions=self.policy_versions[slice(*tokens)], texts=self.texts[first:last],
            finish_reasons=self.finish_reasons[first:last],
            kept_token_ids=None if self.kept_token_ids is None else self.kept_token_ids[slice(*tokens)],
            kept_widths=None if self.kept_widths is None else self.kept_widths[first:last])


@dataclass
class KeptCompletions:
    """A generator's answer for completions it keeps (`Generator.generate_kept`): what the caller scores and selects
    them by, not their tokens. The tensors stay on the replica under `key` until the replay buffer takes the rows it
    trains (`Generator.take_kept`), so they never pass through the caller."""

    key: int
    samples: list[int]  # completions per prompt, in prompt order
    texts: list[str]  # completion after completion, prompt by prompt

    def __len__(self) -> int:
        return len(self.samples)


@dataclass
class KeptPart:
    """The episodes to train from one kept batch: its `rows` (completions, in the kept batch's order) with their ids,
    rewards and advantages. No rows: none is trained, and the buffer only has the replica forget the batch."""

    generator: Any  # the actor handle of the replica that keeps the batch
    key: int
    rows: list[int]
    episode_ids: list[int]
    group_ids: list[int]
    rewards: list[float]
    advantages: list[float]


@dataclass
class KeptEpisodes:
    """Episodes whose tensors generator replicas keep, as the controller hands them to the replay buffer's `add` in
    place of an `EpisodeBatch`: one part per kept batch of a rollout, the batches none of whose groups are trained
    included, so that every kept batch is released."""

    parts: list[KeptPart]

    def __len__(self) -> int:
        return sum(len(part.rows) for part in self.parts)


@dataclass
class EpisodeBatch:
    """Scored episodes, packed for the wire ("On the wire" above): what rollouts hand the replay buffer and the
    reference model. `EpisodeBatch.pack(episodes)` and `batch.unpack()` convert from and to `Episode`s."""

    episode_ids: torch.Tensor  # [N] long
    group_ids: torch.Tensor  # [N] long
    rewards: torch.Tensor  # [N] float32
    advantages: torch.Tensor  # [N] float32
    prompt_lengths: torch.Tensor  # [N] long
    completion_lengths: torch.Tensor  # [N] long
    prompt_ids: torch.Tensor  # [sum of prompt lengths] int32, episode after episode
    completion_ids: torch.Tensor  # [sum of completion lengths] int32, episode after episode
    behaviour_logprobs: torch.Tensor  # float32, like completion_ids
    policy_versions: torch.Tensor  # int32, like completion_ids
    completion_mask: torch.Tensor | None = None  # int8, like completion_ids; None: every token is the model's
    ref_logprobs: torch.Tensor | None = None  # float32, like completion_ids
    ref_topk_ids: torch.Tensor | None = None  # [sum of completion lengths, K] int32 (Episode.ref_topk_ids)
    ref_topk_logprobs: torch.Tensor | None = None  # [sum of completion lengths, K+1] float32
    kept_token_ids: torch.Tensor | None = None  # [sum of completion lengths, K] int32, -1 padded
    kept_widths: torch.Tensor | None = None  # [N] long: each episode's K (0: it sampled the full vocabulary)

    @classmethod
    def pack(cls, episodes: Sequence[Episode]) -> EpisodeBatch:
        lengths = [len(e.completion_ids) for e in episodes]
        for e, length in zip(episodes, lengths):
            _check_token_fields(e, length)
            for name in ("episode_id", "group_id"):
                if not -(1 << 63) <= getattr(e, name) < 1 << 63:
                    raise ValueError(f"Episode {e.episode_id}: {name}={getattr(e, name)} must fit in int64 (it travels "
                                     "as a tensor)")
        masked = any(e.completion_mask is not None for e in episodes)
        has_ref = bool(episodes) and all(e.ref_logprobs is not None for e in episodes)
        has_topk = bool(episodes) and all(e.ref_topk_ids is not None for e in episodes)
        kept, widths = _pack_kept([e.kept_token_ids for e in episodes], lengths,
                                  [f"Episode {e.episode_id}" for e in episodes])
        return cls(
            episode_ids=torch.tensor([e.episode_id for e in episodes], dtype=torch.long),
            group_ids=torch.tensor([e.group_id for e in episodes], dtype=torch.long),
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            advantages=torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
            prompt_lengths=_lengths([e.prompt_ids for e in episodes]),
            completion_lengths=torch.tensor(lengths, dtype=torch.long),
            prompt_ids=_flat([e.prompt_ids for e in episodes], torch.int32),
            completion_ids=_flat([e.completion_ids for e in episodes], torch.int32),
            behaviour_logprobs=_flat([e.behaviour_logprobs for e in episodes], torch.float32),
            policy_versions=_flat([e.policy_versions for e in episodes], torch.int32),
            completion_mask=_flat([[1] * n if e.completion_mask is None else e.completion_mask
                                   for e, n in zip(episodes, lengths)], torch.int8) if masked else None,
            ref_logprobs=_flat([e.ref_logprobs for e in episodes], torch.float32) if has_ref else None,
            ref_topk_ids=torch.cat([e.ref_topk_ids for e in episodes]).to(torch.int32) if has_topk else None,
            ref_topk_logprobs=torch.cat([e.ref_topk_logprobs for e in episodes]).float() if has_topk else None,
            kept_token_ids=kept, kept_widths=widths)

    @classmethod
    def cat(cls, batches: Sequence[EpisodeBatch]) -> EpisodeBatch:
        """One batch of all of `batches`' episodes, in order (an optional field is kept only if every batch has it,
        except the mask and the kept sets, whose absence means "all the model's" and "the full vocabulary")."""
        if len(batches) == 1:
            return batches[0]

        def joined(name: str, fill=None) -> torch.Tensor | None:
            parts = [getattr(b, name) for b in batches]
            if all(p is None for p in parts) or (fill is None and any(p is None for p in parts)):
                return None
            return torch.cat([fill(b) if p is None else p for b, p in zip(batches, parts)])

        width = max((b.kept_token_ids.shape[1] for b in batches if b.kept_token_ids is not None), default=0)

        def kept_rows(b: EpisodeBatch) -> torch.Tensor:
            rows = torch.full((len(b.completion_ids), width), -1, dtype=torch.int32)
            if b.kept_token_ids is not None:
                rows[:, : b.kept_token_ids.shape[1]] = b.kept_token_ids
            return rows

        return cls(**{name: joined(name) for name in (
            "episode_ids", "group_ids", "rewards", "advantages", "prompt_lengths", "completion_lengths", "prompt_ids",
            "completion_ids", "behaviour_logprobs", "policy_versions", "ref_logprobs", "ref_topk_ids",
            "ref_topk_logprobs")},
            completion_mask=joined("completion_mask", lambda b: torch.ones(len(b.completion_ids), dtype=torch.int8)),
            kept_token_ids=torch.cat([kept_rows(b) for b in batches]) if width else None,
            kept_widths=joined("kept_widths", lambda b: torch.zeros(len(b), dtype=torch.long)) if width else None)

    @classmethod
    def from_completions(cls, completions: CompletionBatch, *, episode_ids: Sequence[int], group_ids: Sequence[int],
                         rewards: Sequence[float], advantages: Sequence[float]) -> EpisodeBatch:
        """One episode per completion (in order), its prompt repeated for each: tensor operations only, no list. The
        tensors are copied: `completions` may be one caller's slice of a merged answer, and a view would carry the
        whole answer's storage to the buffer."""
        prompt_of = torch.repeat_interleave(torch.arange(len(completions)), completions.samples)
        return cls(episode_ids=torch.tensor(episode_ids, dtype=torch.long),
                   group_ids=torch.tensor(group_ids, dtype=torch.long),
                   rewards=torch.tensor(rewards, dtype=torch.float32),
                   advantages=torch.tensor(advantages, dtype=torch.float32),
                   prompt_lengths=completions.prompt_lengths[prompt_of],
                   completion_lengths=completions.lengths.clone(),
                   prompt_ids=_gather(completions.prompt_ids, completions.prompt_lengths, prompt_of),
                   completion_ids=completions.token_ids.clone(), behaviour_logprobs=completions.logprobs.clone(),
                   policy_versions=completions.policy_versions.clone(), kept_token_ids=None if completions.kept_token_ids is None else completions.kept_token_ids.clone(),
                   kept_widths=None if completions.kept_widths is None else completions.kept_widths.clone())

    def select(self, rows: Sequence[int] | torch.Tensor) -> EpisodeBatch:
        """The episodes at `rows`, in that order."""
        rows = torch.as_tensor(rows, dtype=torch.long)

        def tokens(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else _gather(values, self.completion_lengths, rows)

        return EpisodeBatch(
            episode_ids=self.episode_ids[rows], group_ids=self.group_ids[rows], rewards=self.rewards[rows],
            advantages=self.advantages[rows], prompt_lengths=self.prompt_lengths[rows],
            completion_lengths=self.completion_lengths[rows],
            prompt_ids=_gather(self.prompt_ids, self.prompt_lengths, rows),
            completion_ids=tokens(self.completion_ids), behaviour_logprobs=tokens(self.behaviour_logprobs),
            policy_versions=tokens(self.policy_versions), completion_mask=tokens(self.completion_mask),
            ref_logprobs=tokens(self.ref_logprobs), ref_topk_ids=tokens(self.ref_topk_ids),
            ref_topk_logprobs=tokens(self.ref_topk_logprobs), kept_token_ids=tokens(self.kept_token_ids),
            kept_widths=None if self.kept_widths is None else self.kept_widths[rows])

    def oldest_policy_versions(self) -> torch.Tensor:
        """[N] long: each episode's oldest version among the model's tokens (`Episode.oldest_policy_version`)."""
        none = torch.iinfo(torch.long).max
        versions = self.policy_versions.long()
        versions = versions.masked_fill(versions < 0, none)
        oldest = torch.full((len(self),), none, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(self)), self.completion_lengths)
        oldest.scatter_reduce_(0, rows, versions, "amin")
        return oldest.masked_fill(oldest == none, -1)

    def unpack(self) -> list[Episode]:
        lengths = self.completion_lengths.tolist()
        columns = [_rows(self.prompt_ids, self.prompt_lengths.tolist()), _rows(self.completion_ids, lengths),
                   _rows(self.behaviour_logprobs, lengths), _rows(self.policy_versions, lengths),
                   [None] * len(lengths) if self.completion_mask is None else _rows(self.completion_mask, lengths),
                   [None] * len(lengths) if self.ref_logprobs is None else _rows(self.ref_logprobs, lengths),
                   _unpack_kept(self.kept_token_ids, self.kept_widths, lengths),
                   _split_rows(self.ref_topk_ids, lengths), _split_rows(self.ref_topk_logprobs, lengths)]
        return [Episode(episode_id=i, group_id=g, prompt_ids=p, completion_ids=c, behaviour_logprobs=b,
                        policy_versions=v, reward=r, advantage=a, ref_logprobs=ref, kept_token_ids=k, completion_mask=m,
                        ref_topk_ids=top_ids, ref_topk_logprobs=top_logprobs)
                for i, g, r, a, p, c, b, v, m, ref, k, top_ids, top_logprobs in zip(
                    self.episode_ids.tolist(), self.group_ids.tolist(), self.rewards.tolist(),
                    self.advantages.tolist(), *columns)]

    def __len__(self) -> int:
        return len(self.episode_ids)

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, position) in a `TrainBatch`'s token-aligned [B, T-1] tensors of each completion token, in the flat
        order of `completion_ids`: completion token i of an episode with a p-token prompt is predicted at p-1+i."""
        return _ragged_index(self.completion_lengths, self.prompt_lengths - 1)


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
    # The teacher's K most likely tokens at each position ([B, T-1, K] long) and their log-probs with the log of the
    # rest of its mass last ([B, T-1, K+1] float; an empty bucket: finfo.min): losses.distill's kl="reverse" or
    # "forward".
    ref_topk_ids: torch.Tensor | None = None
    ref_topk_logprobs: torch.Tensor | None = None
    # [B, T-1, K] int32: the tokens the sampler kept when it drew target t+1, -1 padded (all -1: full vocabulary);
    # None when no episode was sampled with top-k / top-p.
    kept_token_ids: torch.Tensor | None = None
    # [B, T] long: packed rows (SFT), several sequences one after another in a row: which of them each token belongs
    # to. A token attends only to earlier tokens of its own sequence; None: one sequence per row (causal attention).
    document_ids: torch.Tensor | None = None
    # [B, T-1] float: one advantage per target token (the Tinker protocol's losses, losses/tinker.py); None: the
    # per-sequence `advantages` are the only ones.
    token_advantages: torch.Tensor | None = None

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
            ref_topk_ids=None if self.ref_topk_ids is None else self.ref_topk_ids[start:stop],
            ref_topk_logprobs=None if self.ref_topk_logprobs is None else self.ref_topk_logprobs[start:stop],
            kept_token_ids=None if self.kept_token_ids is None else self.kept_token_ids[start:stop],
            document_ids=None if self.document_ids is None else self.document_ids[start:stop],
            token_advantages=None if self.token_advantages is None else self.token_advantages[start:stop],
        )

    @classmethod
    def from_episodes(cls, episodes: Sequence[Episode] | EpisodeBatch, pad_id: int) -> TrainBatch:
        """Right-padded rows, one per episode: each scattered into place with one indexed write per field."""
        packed = episodes if isinstance(episodes, EpisodeBatch) else EpisodeBatch.pack(episodes)
        if not len(packed):
            raise ValueError("TrainBatch.from_episodes: no episodes")
        prompts, completions = packed.prompt_lengths, packed.completion_lengths
        batch, length = len(packed), int((prompts + completions).max())
        # Row r's prompt fills columns [0, p), its completion [p, p + c), predicted at positions [p - 1, p - 1 + c).
        prompt_rows, prompt_cols = _ragged_index(prompts, torch.zeros_like(prompts))
        rows, positions = packed.response_index()
        input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
        input_ids[prompt_rows, prompt_cols] = packed.prompt_ids.long()
        input_ids[rows, positions + 1] = packed.completion_ids.long()

        def response(values: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full((batch, length - 1), fill, dtype=dtype)
            out[rows, positions] = values.to(dtype)
            return out

        mask = packed.completion_mask if packed.completion_mask is not None else torch.ones(len(rows))
        kept = None
        if packed.kept_token_ids is not None:
            kept = torch.full((batch, length - 1, packed.kept_token_ids.shape[1]), -1, dtype=torch.int32)
            kept[rows, positions] = packed.kept_token_ids
        topk_ids = topk_logprobs = None
        if packed.ref_topk_ids is not None:  # off the response: token 0 and log-prob 0 (masked out by the losses)
            topk_ids = torch.zeros((batch, length - 1, packed.ref_topk_ids.shape[1]), dtype=torch.long)
            topk_ids[rows, positions] = packed.ref_topk_ids.long()
            topk_logprobs = torch.zeros((batch, length - 1, packed.ref_topk_logprobs.shape[1]), dtype=torch.float32)
            topk_logprobs[rows, positions] = packed.ref_topk_logprobs
        return cls(
            input_ids=input_ids,
            response_mask=response(mask, 0.0, torch.float32),
            behaviour_logprobs=response(packed.behaviour_logprobs, 0.0, torch.float32),
            policy_versions=response(packed.policy_versions, -1, torch.long),
            advantages=packed.advantages.clone(),
            rewards=packed.rewards.clone(),
            ref_logprobs=None if packed.ref_logprobs is None else response(packed.ref_logprobs, 0.0, torch.float32),
            ref_topk_ids=topk_ids,
            ref_topk_logprobs=topk_logprobs,
            kept_token_ids=kept,
        )


def _check_token_fields(e: Episode, length: int) -> None:
    """Every per-token field has one entry per completion token."""
    for name in ("behaviour_logprobs", "policy_versions", "completion_mask", "ref_logprobs", "ref_topk_ids",
                 "ref_topk_logprobs"):
        values = getattr(e, name)
        if values is not None and len(values) != length:
            raise ValueError(f"Episode {e.episode_id}: {name} has {len(values)} entries; must have one per "
                             f"completion token ({length})")
    if e.ref_topk_ids is not None and (e.ref_topk_logprobs is None or e.ref_topk_ids.dim() != 2
                                       or e.ref_topk_logprobs.shape != (length, e.ref_topk_ids.shape[1] + 1)):
        shape = None if e.ref_topk_logprobs is None else tuple(e.ref_topk_logprobs.shape)
        raise ValueError(f"Episode {e.episode_id}: ref_topk_ids has shape {tuple(e.ref_topk_ids.shape)} and "
                         f"ref_topk_logprobs {shape}; must be [{length}, K] and [{length}, K+1]")


def _flat(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
    """The rows one after another in one 1-D tensor: one conversion for all of them, not one per row."""
    return torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)


def _lengths(rows: Sequence[Sequence]) -> torch.Tensor:
    return torch.tensor([len(row) for row in rows], dtype=torch.long)


def _rows(flat: torch.Tensor, lengths: Sequence[int]) -> list[list]:
    """`_flat`'s rows again, as lists (one `tolist` for all of them)."""
    values, rows, start = flat.tolist(), [], 0
    for length in lengths:
        rows.append(values[start : start + length])
        start += length
    return rows


def _split_rows(flat: torch.Tensor | None, lengths: Sequence[int]) -> list[torch.Tensor | None]:
    """A [sum of lengths, ...] tensor's items as copies (a view would keep and pickle the whole tensor)."""
    if flat is None:
        return [None] * len(lengths)
    return [part.clone() for part in flat.split(list(lengths))]


def _ragged_index(lengths: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element of rows of `lengths` elements that start at column `offsets[row]`."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths  # where each row begins in the flat order
    cols = torch.arange(int(lengths.sum())) - starts[rows] + offsets[rows]
    return rows, cols


def _gather(flat: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The items at `rows` of a flat tensor of items of `lengths`, one after another."""
    starts = torch.cumsum(lengths, 0) - lengths
    picked = lengths[rows]
    within = torch.arange(int(picked.sum())) - torch.repeat_interleave(torch.cumsum(picked, 0) - picked, picked)
    return flat[torch.repeat_interleave(starts[rows], picked) + within]


def _pack_kept(kept: Sequence[torch.Tensor | None], lengths: Sequence[int],
               names: Sequence[str]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Items' kept sets as one [sum of lengths, K] int32 tensor (-1 padded) and each item's K; (None, None) if no item
    has one."""
    widths = []
    for rows, length, name in zip(kept, lengths, names):
        if rows is not None and (rows.dim() != 2 or rows.shape[0] != length):
            raise ValueError(f"{name}: kept_token_ids has shape {tuple(rows.shape)}; must be [{length}, K] (one row "
                             "per completion token)")
        widths.append(0 if rows is None else rows.shape[1])
    if not any(widths):
        return None, None
    packed, start = torch.full((sum(lengths), max(widths)), -1, dtype=torch.int32), 0
    for rows, length in zip(kept, lengths):
        if rows is not None:
            packed[start : start + length, : rows.shape[1]] = rows
        start += length
    return packed, torch.tensor(widths, dtype=torch.long)


def _unpack_kept(packed: torch.Tensor | None, widths: torch.Tensor | None,
                 lengths: Sequence[int]) -> list[torch.Tensor | None]:
    if packed is None:
        return [None] * len(lengths)
    out, start = [], 0
    for width, length in zip(widths.tolist(), lengths):
        # A copy, not a view: a view would keep (and pickle) the whole packed tensor.
        out.append(packed[start : start + length, :width].clone() if width else None)
        start += length
    return out
