"""A session's training requests: forward, forward_backward (gradients accumulated) and optim_step, each run in
the session's seq_id order; a forward or forward_backward may arrive in chunks and runs as one batch."""

from __future__ import annotations

import json
from typing import Any, Callable

from apps.server.batches import batch_temperature, build_batch, check_loss, check_loss_inputs, concat_batches
from apps.server.config import ServerConfig
from apps.http.errors import ServiceError
from apps.http.model import TokenizerInfo
from apps.server.schemas import (
    ChunkAccepted,
    ForwardBackwardRequest,
    ForwardBackwardResponse,
    ForwardRequest,
    LossFnOutput,
    OptimStepRequest,
    OptimStepResponse,
    SequencedRequest,
)
from apps.server.sessions import Session, SessionRegistry

# One chunk of a forward/forward_backward request: its batch, its sequences' lengths, the temperature it is at.
BatchPart = tuple[Any, list[int], float]


class Training:
    def __init__(self, cfg: ServerConfig, model: TokenizerInfo, registry: SessionRegistry) -> None:
        self.cfg = cfg
        self.model = model
        self.registry = registry

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        return await self._run_scored(request, "forward_backward")

    async def forward(self, request: ForwardRequest) -> ForwardBackwardResponse | ChunkAccepted:
        return await self._run_scored(request, "forward")

    async def optim_step(self, request: OptimStepRequest) -> OptimStepResponse:
        adam = request.adam_params

        async def execute(session: Session, seq_id: int, parts: list) -> OptimStepResponse:
            out = await session.call("optim_step", adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                     adam.weight_decay, adam.grad_clip_norm)
            session.step = int(out["step"])
            return OptimStepResponse(model_id=session.session_id, seq_id=seq_id, step=session.step,
                                     grad_norm=out["grad_norm"], learning_rate=out["lr"],
                                     accumulated_batches=int(out["accumulated_batches"]))

        return await self.registry.run_in_order(request, "optim_step", execute)

    async def run_batch(self, model_id: str, seq_id: int | None, endpoint: str, build: Callable[[], Any],
                        loss: str | None, loss_params: dict, temperature: float) -> tuple[Any, dict[str, Any]]:
        """`endpoint` (forward_backward or forward) of session `model_id`'s trainer on the batch `build()` makes
        and checks (the Tinker protocol's, apps/server/tinker/service.py), in the session's seq_id order; a
        ServiceError from `build` gives up the seq_id at once. Returns the batch and the trainer's answer: loss,
        metrics and the log-probs [B, T-1]."""
        async def execute(session: Session, seq: int, parts: list) -> tuple[Any, dict[str, Any]]:
            return parts[0], await session.call(endpoint, parts[0], loss, dict(loss_params), temperature)

        return await self.registry.run_in_order(SequencedRequest(model_id=model_id, seq_id=seq_id), endpoint, execute,
                                                build)

    async def _run_scored(self, request: ForwardRequest | ForwardBackwardRequest,
                          endpoint: str) -> ForwardBackwardResponse | ChunkAccepted:
        """`endpoint` (forward_backward or forward) of the session's trainer on the request, once all its chunks
        are in; each chunk is checked as it arrives."""
        async def execute(session: Session, seq_id: int, parts: list[BatchPart]) -> ForwardBackwardResponse:
            return await self._run_batch(session, seq_id, parts, endpoint, request.loss_fn, request.loss_fn_params)

        signature = (endpoint, request.loss_fn, json.dumps(request.loss_fn_params, sort_keys=True))
        return await self.registry.run_in_order(request, endpoint, execute, lambda: self._batch_part(request),
                                                chunk_index=request.chunk_index, num_chunks=request.num_chunks,
                                                signature=signature)

    def _batch_part(self, request: ForwardRequest | ForwardBackwardRequest) -> BatchPart:
        """The request's batch (checked datum by datum), its sequence lengths and the temperature its log-probs are
        at; with a loss, the loss's name and parameters are checked on this batch too."""
        loss = request.loss_fn
        if loss is not None:
            check_loss(loss, request.loss_fn_params, allow_custom=False)
        batch = build_batch(request.data, pad_id=self.model.pad_id, vocab_size=self.model.vocab_size,
                            max_len=self.model.max_model_len, needs_rl_inputs=loss is not None)
        if loss is not None:
            check_loss_inputs(loss, request.loss_fn_params, batch)
        temperature = batch_temperature(request.data, self.cfg.trainer.temperature)
        return batch, [len(d.model_input.tokens()) for d in request.data], temperature

    async def _run_batch(self, session: Session, seq_id: int, parts: list[BatchPart], endpoint: str,
                         loss: str | None, loss_params: dict) -> ForwardBackwardResponse:
        """`endpoint` of the session's trainer on the request's chunks as one batch, scored at the temperature its
        log-probs are at."""
        temperatures = {p[2] for p in parts}
        if len(temperatures) > 1:
            raise ServiceError(422, f"loss_fn_inputs.temperature: the chunks of one request are at temperatures "
                                    f"{sorted(temperatures)}; give one temperature in every chunk")
        batch = concat_batches([p[0] for p in parts], self.model.pad_id)
        lengths = [n for p in parts for n in p[1]]
        out = await session.call(endpoint, batch, loss, dict(loss_params), temperatures.pop())
        return ForwardBackwardResponse(model_id=session.session_id, seq_id=seq_id, num_datums=len(lengths),
                                       loss=out["loss"], metrics=out["metrics"],
                                       loss_fn_outputs=per_datum(out["logprobs"], lengths))


def per_datum(logprobs: Any, lengths: list[int]) -> list[LossFnOutput]:
    """The batch's log-probs [B, T-1], each row cut to its sequence's length - 1."""
    rows = logprobs.tolist()
    return [LossFnOutput(logprobs=row[: n - 1]) for row, n in zip(rows, lengths)]
