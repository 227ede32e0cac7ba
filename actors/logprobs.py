"""Per-token quantities of sequences under a model: log-probs and entropies at the sampling temperature, and
scoring a batch a few rows at a time across data-parallel ranks. Shared by the trainer and the reference model."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from forge.distributed import DataParallel

if TYPE_CHECKING:
    from torchtitan.models.common import Decoder


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   kept_token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / temperature) at the target tokens, in float32: [..., V], [...] -> [...].

    With `kept_token_ids` ([..., K], -1 padded: what top-k / top-p sampling kept, see rl.types) a position
    with kept ids is renormalised over exactly those tokens, the distribution the sampler drew from: its log-prob
    is z_target / T - logsumexp(z_kept / T). A position whose ids are all -1 uses the full vocabulary. A target
    outside its position's kept set cannot have been sampled from it: a ValueError, not a log-prob of -inf.
    """
    logits = logits.float() / temperature
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    full = -nll.view(targets.shape)
    if kept_token_ids is None:
        return full
    if kept_token_ids.shape[:-1] != targets.shape:
        raise ValueError(f"kept_token_ids: shape {tuple(kept_token_ids.shape)}; must be [*targets.shape, K] = "
                         f"[{', '.join(map(str, targets.shape))}, K]")
    kept = kept_token_ids.long()
    valid = kept >= 0
    masked = valid.any(-1)
    target_kept = (kept == targets.unsqueeze(-1)).any(-1)
    if not bool((target_kept | ~masked).all()):
        position = tuple((masked & ~target_kept).nonzero()[0].tolist())
        raise ValueError(f"kept_token_ids: at position {position} the target token {int(targets[position])} is not "
                         "in the kept set it was sampled from (kept sets misaligned with the targets?)")
    # Rows without a kept set gather token 0 instead of all -inf: their logsumexp stays finite, so the unused
    # branch of the `where` below back-propagates zeros, not NaNs.
    in_sum = valid | ~masked.unsqueeze(-1)
    kept_logits = logits.gather(-1, kept.clamp(min=0)).masked_fill(~in_sum, float("-inf"))
    truncated = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - kept_logits.logsumexp(-1)
    return torch.where(masked, truncated, full)


def topk_logprobs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The K = min(k, V) most likely tokens of softmax(logits / temperature) at each position and their log-probs,
    the log of the rest of the mass last: [..., V] -> ids [..., K] long, log-probs [..., K+1] float32 (the
    teacher's side of losses.distill's kl="reverse" / "forward"; float64 logits stay float64)."""
    logprobs = (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).log_softmax(-1)
    ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1).indices
    return ids, bucket_logprobs(logprobs, ids)


def bucket_logprobs(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [..., V] at `ids` [..., K] and the log of the mass outside them last: [..., K+1], differentiable.
    An empty rest (K = V) is `torch.finfo(dtype).min`, not -inf: losses.distill's p (log p - log q) is then 0 * 0,
    and its gradient 0, where -inf would make both NaN."""
    floor = torch.finfo(logprobs.dtype).min
    rest = logprobs.scatter(-1, ids, floor).logsumexp(-1, keepdim=True).clamp(min=floor)
    return torch.cat([logprobs.gather(-1, ids), rest], dim=-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, in float32: [..., V] -> [...]."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def check_input_ids(input_ids: torch.Tensor, model_args: Decoder.Config) -> None:
    """Raise a ValueError unless input_ids is a long [B, T] tensor the model (torchtitan's configuration of it) can
    take."""
    max_len, vocab = model_args.max_seq_len, model_args.vocab_size
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or not 2 <= input_ids.shape[1] <= max_len:
        raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}; must be a long "
                         f"tensor [B, T] with 2 <= T <= {max_len} (the model's max_position_embeddings)")
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        raise ValueError(f"input_ids: token ids in [{int(input_ids.min())}, {int(input_ids.max())}]; "
                         f"must be in [0, {vocab}) (the vocabulary)")


@contextlib.contextmanager
def without_dropout(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for the block, then back in its own mode: a score is the policy itself, not one draw of
    its dropout masks (LoRA's `dropout`), so scoring the same weights twice gives the same log-probs."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def draws_dropout(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward pass samples dropout masks now (in train mode, with a dropout of p > 0)."""
    return model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def score_rows(score: Callable[..., torch.Tensor], input_ids: torch.Tensor, rows_per_pass: int,
               dp: DataParallel, kept_token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`score(rows)` ([b, T] -> [b, T-1]) of the whole batch [B, T]: this rank scores its data-parallel rows,
    `rows_per_pass` at a time (peak memory is one pass's logits), and every rank gets all rows: [B, T-1] on CPU.
    Given `kept_token_ids` ([B, T-1, K]), each pass calls `score(rows, their_kept_token_ids)`."""
    start, stop = dp.rows(input_ids.shape[0])
    local = []
    for s in range(start, stop, rows_per_pass):
        rows = slice(s, min(s + rows_per_pass, stop))
        local.append(score(input_ids[rows]) if kept_token_ids is None else score(input_ids[rows], kept_token_ids[rows]))
    return dp.gather_rows(torch.cat(local)).cpu()
