"""Request data -> `rl.types.TrainBatch`, checked datum by datum (errors give the datum's index and field)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from apps.http.errors import ServiceError, field_error
from apps.server.moved import moved_from
from apps.server.schemas import Datum
from losses.rules import uses_old_logprobs
from rl.sampling import MAX_KEPT_TOKENS
from rl.types import TrainBatch
from losses import LOSSES, get_loss

_SUPPLIED = {"logprobs", "batch", "old_logprobs"}  # the trainer passes these itself


def check_loss(name: str, params: dict[str, Any], *, allow_custom: bool) -> None:
    """422 for an unknown loss or a parameter the loss does not take."""
    if name not in LOSSES and not allow_custom:
        raise field_error(["loss_fn"], name, f"unknown loss; must be one of {', '.join(LOSSES)}")
    try:
        loss_fn = get_loss(name)
    except (TypeError, ValueError) as e:
        raise field_error(["loss_fn"], name, str(e)) from None
    parameters = inspect.signature(loss_fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    taken = sorted({p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL} - _SUPPLIED)
    for key in params:
        if key not in taken:
            raise field_error(["loss_fn_params", key], params[key], f"not a parameter of loss {name!r}; allowed: {taken}")


def check_loss_inputs(name: str, params: dict[str, Any], batch: TrainBatch) -> None:
    """422 unless the loss runs on this batch with these parameters (a parameter's value or type, a KL term
    without ref_logprobs): evaluated here on the behaviour log-probs, so the trainer never meets a request
    that cannot work and whatever it raises is the server's failure."""
    # pi_old stands in as the behaviour log-probs: only shapes and parameters are checked here.
    old = {"old_logprobs": batch.behaviour_logprobs} if uses_old_logprobs(params) else {}
    try:
        get_loss(name)(batch.behaviour_logprobs, batch, **params, **old)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise field_error(["loss_fn_params"], params, f"loss {name!r} cannot run on this request: "
                                                      f"{type(e).__name__}: {e}") from None


def build_batch(data: list[Datum], *, pad_id: int, vocab_size: int, max_len: int, needs_rl_inputs: bool,
                offset: int = 0) -> TrainBatch:
    """Right-padded tensors for the datums. `needs_rl_inputs`: logprobs and advantages are required (a loss
    runs). `offset` is the index of data[0] in the whole (chunked) request, for error locations."""
    rows = []
    for i, datum in enumerate(data):
        rows.append(_row(datum, offset + i, vocab_size=vocab_size, max_len=max_len,
                         needs_rl_inputs=needs_rl_inputs))
    has_ref = [r["ref"] is not None for r in rows]
    if any(has_ref) and not all(has_ref):
        first = has_ref.index(not has_ref[0]) + offset
        raise field_error(["data", first, "loss_fn_inputs", "ref_logprobs"], None,
                          "give ref_logprobs for every datum or for none")
    length = max(len(r["ids"]) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, length - 1)
    behaviour = torch.zeros(batch, length - 1)
    versions = torch.full((batch, length - 1), -1, dtype=torch.long)
    ref = torch.zeros(batch, length - 1) if all(has_ref) else None
    kept = _kept_tensor([r["kept"] for r in rows], length)
    for row, r in enumerate(rows):
        n = len(r["ids"])
        input_ids[row, :n] = torch.tensor(r["ids"], dtype=torch.long)
        mask[row, : n - 1] = torch.tensor(r["mask"], dtype=torch.float32)
        behaviour[row, : n - 1] = torch.tensor(r["logprobs"], dtype=torch.float32)
        versions[row, : n - 1] = torch.tensor(r["versions"], dtype=torch.long)
        if ref is not None:
            ref[row, : n - 1] = torch.tensor(r["ref"], dtype=torch.float32)
    return TrainBatch(input_ids=input_ids, response_mask=mask, behaviour_logprobs=behaviour, policy_versions=versions,
                      advantages=torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
                      rewards=torch.tensor([r["reward"] for r in rows], dtype=torch.float32), ref_logprobs=ref,
                      kept_token_ids=kept)


def _kept_tensor(rows: list[list[list[int]] | None], length: int) -> torch.Tensor | None:
    """The datums' kept sets as TrainBatch.kept_token_ids ([B, T-1, K] int32, -1 padded: all -1 is the full
    vocabulary); None when no position of any datum has one."""
    width = max((len(ids) for kept in rows if kept is not None for ids in kept), default=0)
    if not width:
        return None
    out = torch.full((len(rows), length - 1, width), -1, dtype=torch.int32)
    for row, kept in enumerate(rows):
        for t, ids in enumerate(kept or []):
            out[row, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def batch_temperature(data: list[Datum], default: float) -> float:
    """The one temperature the datums' log-probs are at (loss_fn_inputs.temperature; `default`, the trainer's, where
    none is given). The trainer scores a batch at one temperature: a datum at another is a 422 naming it."""
    temperatures = [default if d.loss_fn_inputs.temperature is None else d.loss_fn_inputs.temperature for d in data]
    for i, temperature in enumerate(temperatures):
        if temperature != temperatures[0]:
            raise field_error(["data", i, "loss_fn_inputs", "temperature"], temperature,
                              f"must equal data[0]'s {temperatures[0]} (trainer.temperature={default} where none is "
                              "given): one temperature per request; send samples of another temperature in a "
                              "request of their own")
    return temperatures[0]


def concat_batches(batches: list[TrainBatch], pad_id: int) -> TrainBatch:
    """Chunks of one request -> one batch (re-padded to the longest row)."""
    if len(batches) == 1:
        return batches[0]
    length = max(b.input_ids.shape[1] for b in batches)

    def pad(t: torch.Tensor | None, width: int, value: float) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    width = max((b.kept_token_ids.shape[2] for b in batches if b.kept_token_ids is not None), default=0)

    def kept(b: TrainBatch) -> torch.Tensor | None:  # every chunk's kept sets at one width (-1: none)
        if not width:
            return None
        out = torch.full((b.input_ids.shape[0], length - 1, width), -1, dtype=torch.int32)
        if b.kept_token_ids is not None:
            out[:, : b.kept_token_ids.shape[1], : b.kept_token_ids.shape[2]] = b.kept_token_ids
        return out

    parts = [TrainBatch(input_ids=pad(b.input_ids, length, pad_id), response_mask=pad(b.response_mask, length - 1, 0),
                        behaviour_logprobs=pad(b.behaviour_logprobs, length - 1, 0),
                        policy_versions=pad(b.policy_versions, length - 1, -1), advantages=b.advantages,
                        rewards=b.rewards, ref_logprobs=pad(b.ref_logprobs, length - 1, 0), kept_token_ids=kept(b))
             for b in batches]
    refs = [p.ref_logprobs is not None for p in parts]
    if any(refs) and not all(refs):
        raise ServiceError(422, "ref_logprobs: give them in every chunk or in none")
    return TrainBatch(**{name: torch.cat([getattr(p, name) for p in parts]) if getattr(parts[0], name) is not None
                         else None for name in TrainBatch.__dataclass_fields__})


def _row(datum: Datum, i: int, *, vocab_size: int, max_len: int, needs_rl_inputs: bool) -> dict:
    ids = datum.model_input.tokens()
    loc = ["data", i]
    if not 2 <= len(ids) <= max_len:
        raise field_error([*loc, "model_input"], len(ids), f"sequence of {len(ids)} tokens; must have 2 to {max_len} "
                                                           "(the model's window)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise field_error([*loc, "model_input"], bad[:5], f"token ids outside the vocabulary [0, {vocab_size})")
    inputs = datum.loss_fn_inputs
    n = len(ids) - 1
    where = [*loc, "loss_fn_inputs"]

    def per_token(name: str, value: list | None) -> None:
        if value is not None and len(value) != n:
            raise field_error([*where, name], f"{len(value)} values",
                              f"must have len(input_ids) - 1 = {n} values (position t predicts input_ids[t+1])")

    for name in ("logprobs", "mask", "target_tokens", "policy_versions", "ref_logprobs", "kept_token_ids"):
        per_token(name, getattr(inputs, name))
    _check_kept(inputs.kept_token_ids, ids, [*where, "kept_token_ids"], vocab_size)
    if isinstance(inputs.advantages, list):
        per_token("advantages", inputs.advantages)
    if inputs.target_tokens is not None and inputs.target_tokens != ids[1:]:
        raise field_error([*where, "target_tokens"], inputs.target_tokens[:8], "must equal input_ids[1:]")
    if needs_rl_inputs:
        for name in ("logprobs", "advantages"):
            if getattr(inputs, name) is None:
                raise field_error([*where, name], None, "required by the loss")
    if inputs.mask is not None:
        mask = [float(m) for m in inputs.mask]
        if any(m < 0 for m in mask):
            raise field_error([*where, "mask"], inputs.mask[:8], "must be >= 0")
    elif isinstance(inputs.advantages, list):
        mask = [1.0 if a != 0 else 0.0 for a in inputs.advantages]
    elif needs_rl_inputs:
        raise field_error([*where, "mask"], None, "required when advantages is one number per sequence "
                                                  "(1 on the completion's positions)")
    else:
        mask = [0.0] * n
    advantage = 0.0
    if isinstance(inputs.advantages, list):
        on_mask = {round(a, 6) for a, m in zip(inputs.advantages, mask) if m > 0}
        if len(on_mask) > 1:
            raise field_error([*where, "advantages"], sorted(on_mask)[:5],
                              "per-token advantages must be one value on the trained positions (forge's losses "
                              "take one advantage per sequence)")
        advantage = next((a for a, m in zip(inputs.advantages, mask) if m > 0), 0.0)
    elif inputs.advantages is not None:
        advantage = float(inputs.advantages)
    return {"ids": ids, "mask": mask, "logprobs": inputs.logprobs or [0.0] * n, "advantage": advantage,
            "versions": inputs.policy_versions or [0] * n, "ref": inputs.ref_logprobs, "reward": inputs.reward,
            "kept": inputs.kept_token_ids}


def _check_kept(kept: list[list[int]] | None, ids: list[int], loc: list, vocab_size: int) -> None:
    """Each position's kept set (if any) is a set the sampler could keep and holds the token it drew."""
    for t, kept_ids in enumerate(kept or []):
        if not kept_ids:
            continue
        if len(kept_ids) > MAX_KEPT_TOKENS:
            raise field_error([*loc, t], f"{len(kept_ids)} ids", f"at most {MAX_KEPT_TOKENS} kept tokens per "
                                                                 "position (rl.sampling.MAX_KEPT_TOKENS)")
        if any(not 0 <= k < vocab_size for k in kept_ids):
            raise field_error([*loc, t], kept_ids[:8], f"token ids outside the vocabulary [0, {vocab_size})")
        if ids[t + 1] not in kept_ids:
            raise field_error([*loc, t], kept_ids[:8], f"does not hold input_ids[{t + 1}]={ids[t + 1]}, the token "
                                                       "sampled from it (kept sets misaligned with the tokens?)")


# tinker_batch moved to apps.server.tinker.batches (the Tinker protocol's pieces): importable from here for a release.
__getattr__ = moved_from(__name__)
