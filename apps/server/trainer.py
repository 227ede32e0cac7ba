"""The training service's trainer: forge's TitanTrainer / TrainerActor with the Tinker-style primitives a
remote client drives step by step.

- `forward_backward`: loss on the whole request's batch, gradients accumulated (no optimizer step);
  exact over micro-batches for any loss, like `TitanTrainer.train_step`.
- `forward`: per-token log-probs (and the loss's value when one is named), no gradients.
- `optim_step`: one AdamW step with the request's parameters on the accumulated gradients, then zero them.
- `save_state` / `load_state` with or without the optimizer; `export_hf` and `publish` are TrainerActor's.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import torch
from torchtitan.distributed import utils as titan_dist

from actors import checkpoint
from actors.logprobs import check_input_ids
from actors.titan_trainer import TitanTrainer
from actors.trainer import TrainerActor
from forge.actor import endpoint
from forge.distributed import init_from_environment
from losses.rules import uses_old_logprobs
from rl.types import TrainBatch
from forge.weights.store import WeightStore
from losses import get_loss


def _on_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return TrainBatch(**{k: None if v is None else v.to(device) for k, v in values.items()})


class ServerTrainer(TitanTrainer):
    """TitanTrainer split into forward_backward / optim_step, with weights-only checkpoints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulated = 0  # forward_backward calls since the last optimizer step
        self._model_only = False

    def forward_backward(self, batch: TrainBatch, loss: str, loss_params: dict[str, Any],
                         temperature: float | None = None) -> dict[str, Any]:
        """Accumulate d(loss)/d(params) for the whole batch, its log-probs at `temperature` (the one its sampling
        log-probs are at; None: the trainer's); returns the loss, its metrics and the log-probs."""
        check_input_ids(batch.input_ids, self.model_args)
        loss_fn = get_loss(loss)
        batch = _on_device(batch, self.device)
        # The weights change only at optim_step, so they are pi_old for every forward_backward before it.
        out, logprobs, _ = self.accumulate_gradients(batch, loss_fn, loss_params, temperature=temperature,
                                                     old_is_current=uses_old_logprobs(loss_params))
        self.accumulated += 1
        return {"loss": out.loss.item(), "metrics": dict(out.metrics), "logprobs": logprobs.cpu()}

    @torch.no_grad()
    def forward_only(self, batch: TrainBatch, loss: str | None, loss_params: dict[str, Any],
                     temperature: float | None = None) -> dict[str, Any]:
        logprobs = self.logprobs(batch, temperature)
        result: dict[str, Any] = {"logprobs": logprobs, "loss": None, "metrics": {}}
        if loss is not None:
            # A rollout correction needs pi_old: the weights since the last optim_step, these very log-probs.
            pi_old = {"old_logprobs": logprobs} if uses_old_logprobs(loss_params) else {}
            out = get_loss(loss)(logprobs, batch, **loss_params, **pi_old)
            result.update(loss=out.loss.item(), metrics=dict(out.metrics))
        return result

    def optim_step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   max_grad_norm: float | None) -> dict[str, float]:
        """One AdamW step on the accumulated gradients with these hyperparameters; gradients are then zeroed."""
        for optimizer in self.optimizers.optimizers:
            for group in optimizer.param_groups:
                group.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        clip = self.config.max_grad_norm if max_grad_norm is None else max_grad_norm
        # The optimizer's parameters: with LoRA sessions sharing a model, another session's pending gradients
        # are not this step's (apps/server/lora_trainer.py).
        params = [p for optimizer in self.optimizers.optimizers for group in optimizer.param_groups
                  for p in group["params"]]
        grad_norm = titan_dist.clip_grad_norm_(params, clip, foreach=True)
        accumulated, self.accumulated = self.accumulated, 0
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.train_state.step += 1
        return {"step": float(self.step), "grad_norm": float(grad_norm.item()), "lr": lr,
                "accumulated_batches": float(accumulated)}

    # -- checkpoints with or without the optimizer --------------------------------------------------
    def _checkpoint_states(self) -> dict[str, Any]:
        states = super()._checkpoint_states()
        if self._model_only:
            for key in checkpoint.OPTIMIZER_PARTS:
                states.pop(key)
        return states

    def save_state(self, path: str, with_optimizer: bool) -> str:
        self._model_only = not with_optimizer
        try:
            return self.save_checkpoint(path)
        finally:
            self._model_only = False

    def load_state(self, path: str, with_optimizer: bool) -> None:
        if with_optimizer:
            self.load_checkpoint(path)
            return
        self._model_only = True
        try:
            self.load_checkpoint(path)
        finally:
            self._model_only = False


class ServerTrainerActor(TrainerActor):
    """TrainerActor serving one training session of the REST service at a time (`reset` between sessions).
    Publishing stays TrainerActor's own path (`_publish`: WeightStore, old versions deleted); the server picks
    the version number, so versions keep growing across sessions."""

    @endpoint
    async def setup(self) -> None:
        rank, world_size = init_from_environment(self.config.device)
        self.trainer = ServerTrainer(self.config, rank=rank, world_size=world_size)
        self.store = WeightStore(self.weight_namespace)

    @endpoint
    async def reset(self) -> None:
        """Back to the served model's weights and a fresh optimizer, for the next session that takes this actor."""
        self.trainer = None  # free the previous session's model and optimizer state first
        rank, world_size = init_from_environment(self.config.device)
        self.trainer = ServerTrainer(self.config, rank=rank, world_size=world_size)

    @endpoint
    async def forward_backward(self, batch: TrainBatch, loss: str, loss_params: dict,
                               temperature: float | None = None) -> dict:
        started = time.perf_counter()
        out = self.trainer.forward_backward(batch, loss, loss_params, temperature)
        out["seconds"] = time.perf_counter() - started
        return out

    @endpoint
    async def forward(self, batch: TrainBatch, loss: str | None, loss_params: dict,
                      temperature: float | None = None) -> dict:
        return self.trainer.forward_only(batch, loss, loss_params, temperature)

    @endpoint
    async def optim_step(self, lr: float, betas: tuple, eps: float, weight_decay: float,
                         max_grad_norm: float | None) -> dict:
        return self.trainer.optim_step(lr, tuple(betas), eps, weight_decay, max_grad_norm)

    @endpoint
    async def save_state(self, path: str, with_optimizer: bool) -> dict:
        self.trainer.save_state(path, with_optimizer)
        return {"path": path, "step": self.trainer.step}

    @endpoint
    async def load_state(self, path: str, with_optimizer: bool) -> dict:
        self.trainer.load_state(path, with_optimizer)
        return {"path": path, "step": self.trainer.step}

    @endpoint
    async def publish_as(self, version: int) -> int:
        """Publish the current weights as policy `version` (chosen by the server; must grow)."""
        self.trainer.train_state.policy_version = version
        return await self._publish()

    @endpoint
    async def state(self) -> dict:
        return {"step": self.trainer.step, "accumulated_batches": self.trainer.accumulated}
