"""Per-token quantities of sequences under a model: log-probs and entropies at the sampling temperature, and
scoring a batch a few rows at a time across data-parallel ranks. Shared by the trainer and the reference model."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torchtitan.protocols import BaseModelArgs

from forge.distributed import DataParallel


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at the target tokens, in float32: [..., V], [...] -> [...]."""
    logits = logits.float() / temperature
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    return -nll.view(targets.shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, in float32: [..., V] -> [...]."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def check_input_ids(input_ids: torch.Tensor, model_args: BaseModelArgs) -> None:
    """Raise a ValueError unless input_ids is a long [B, T] tensor the model can take."""
    max_len, vocab = model_args.max_seq_len, model_args.vocab_size
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or not 2 <= input_ids.shape[1] <= max_len:
        raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}; must be a long "
                         f"tensor [B, T] with 2 <= T <= {max_len} (the model's max_position_embeddings)")
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        raise ValueError(f"input_ids: token ids in [{int(input_ids.min())}, {int(input_ids.max())}]; "
                         f"must be in [0, {vocab}) (the vocabulary)")


def score_rows(score: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, rows_per_pass: int,
               dp: DataParallel) -> torch.Tensor:
    """`score(rows)` ([b, T] -> [b, T-1]) of the whole batch [B, T]: this rank scores its data-parallel rows,
    `rows_per_pass` at a time (peak memory is one pass's logits), and every rank gets all rows: [B, T-1] on CPU."""
    start, stop = dp.rows(input_ids.shape[0])
    local = [score(input_ids[s : min(s + rows_per_pass, stop)]) for s in range(start, stop, rows_per_pass)]
    return dp.gather_rows(torch.cat(local)).cpu()
