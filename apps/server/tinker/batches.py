"""The Tinker protocol's datums (tinker/wire.py decodes them) -> `rl.types.TrainBatch`, checked datum by datum (a 400
names the datum and field)."""

from __future__ import annotations

from typing import Any

import torch

from apps.http.errors import ServiceError
from rl.types import TrainBatch

# Tinker's datum: N input tokens, and every loss_fn_inputs entry has N values, entry t being about the token that
# follows input t. forge's batch holds N + 1 tokens (the input, then the last target) and N per-token values.
_TINKER_INPUTS = {"cross_entropy": ("target_tokens",), "importance_sampling": ("target_tokens", "logprobs", "advantages"),
                  "ppo": ("target_tokens", "logprobs", "advantages"), "cispo": ("target_tokens", "logprobs", "advantages")}
_TINKER_KNOWN_INPUTS = {"target_tokens", "weights", "logprobs", "advantages"}


def tinker_batch(data: list[Any], loss: str, *, pad_id: int, vocab_size: int, max_len: int) -> TrainBatch:
    """`data` (wire.WireDatum) for Tinker loss `loss` as one right-padded batch; a 400 naming the datum and
    field for a datum the loss cannot run on."""
    if not data:
        raise ServiceError(400, "data: empty; send at least one datum")
    rows = [_tinker_row(d, i, loss, vocab_size=vocab_size, max_len=max_len) for i, d in enumerate(data)]
    length = max(len(r["ids"]) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    per_token = {name: torch.zeros(len(rows), length - 1) for name in ("weights", "logprobs", "advantages")}
    for row, r in enumerate(rows):
        n = len(r["ids"])
        input_ids[row, :n] = torch.tensor(r["ids"], dtype=torch.long)
        for name, values in per_token.items():
            values[row, : n - 1] = torch.as_tensor(r[name], dtype=torch.float32)
    zeros = torch.zeros(len(rows))
    return TrainBatch(input_ids=input_ids, response_mask=per_token["weights"], behaviour_logprobs=per_token["logprobs"],
                      policy_versions=torch.zeros(len(rows), length - 1, dtype=torch.long), advantages=zeros,
                      rewards=zeros, token_advantages=per_token["advantages"])


def _tinker_row(datum: Any, i: int, loss: str, *, vocab_size: int, max_len: int) -> dict:
    tokens, inputs = list(datum.tokens), datum.inputs
    where = f"data[{i}]"
    if not 1 <= len(tokens) < max_len:
        raise ServiceError(400, f"{where}.model_input: {len(tokens)} tokens; must be 1 to {max_len - 1} (the model's "
                                f"window is {max_len}, and the last target takes one more position)")
    unknown = sorted(set(inputs) - _TINKER_KNOWN_INPUTS)
    if unknown:
        raise ServiceError(400, f"{where}.loss_fn_inputs: {unknown} not taken by this server's losses; allowed: "
                                f"{sorted(_TINKER_KNOWN_INPUTS)}")
    for name in _TINKER_INPUTS.get(loss, ("target_tokens",)):
        if name not in inputs:
            raise ServiceError(400, f"{where}.loss_fn_inputs[{name!r}]: missing; loss {loss!r} needs "
                                    f"{list(_TINKER_INPUTS[loss])}")
    n = len(tokens)
    for name, values in inputs.items():
        if values.ndim != 1 or values.shape[0] != n:
            raise ServiceError(400, f"{where}.loss_fn_inputs[{name!r}]: shape {list(values.shape)}; must be [{n}], one "
                                    f"value per model_input token (model_input has {n} tokens; entry t is about the "
                                    "token after input t)")
    targets = [int(t) for t in inputs["target_tokens"]]
    bad = [t for t in [*tokens, *targets] if not 0 <= t < vocab_size]
    if bad:
        raise ServiceError(400, f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if targets[:-1] != tokens[1:]:
        t = next(k for k in range(n - 1) if targets[k] != tokens[k + 1])
        raise ServiceError(400, f"{where}.loss_fn_inputs['target_tokens'][{t}]={targets[t]}: must be model_input "
                                f"token {t + 1} ({tokens[t + 1]}); this server trains on the next-token targets of "
                                "the input (target_tokens = input[1:] + [one more token])")
    ones = [1.0] * n
    weights = inputs["weights"].tolist() if "weights" in inputs else ones
    if any(w < 0 for w in weights):
        raise ServiceError(400, f"{where}.loss_fn_inputs['weights']: negative values; weights must be >= 0")
    return {"ids": tokens + targets[-1:], "weights": weights,
            "logprobs": inputs["logprobs"].tolist() if "logprobs" in inputs else [0.0] * n,
            "advantages": inputs["advantages"].tolist() if "advantages" in inputs else [0.0] * n}
