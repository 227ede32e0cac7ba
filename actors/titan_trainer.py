"""The policy trainer: a TorchTitan model trained on RL batches, FSDP2-sharded across data-parallel ranks.

A plain class; the trainer actor (actors/trainer.py) wraps it. The model, its parallelization, the optimizer,
the LR schedule, the Hugging Face name mapping and the checkpoint state containers are torchtitan's own
components. What this adds is what RL needs on top of them: a policy loss over per-token log-probs with exact
gradient accumulation, several optimizer steps per policy version, and the weights in Hugging Face names.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.distributed import utils as titan_dist

from actors import checkpoint, lora
from actors.logprobs import (bucket_logprobs, check_input_ids, draws_dropout, score_rows, token_entropy, token_logprobs,
                             without_dropout)
from actors.lora_config import LoRAConfig
from actors.model_builder import DocumentMask, ModelSettings, build_model, parallel_dims, resolve_model_path
from actors.trainer_config import CheckpointMismatch, TrainerConfig
from forge.distributed import DataParallel, gather_to_rank0, local_device
from losses.rules import PI_OLD_PARAMS, uses_old_logprobs
from rl.types import TrainBatch
from losses import LossOutput, get_loss
from losses.mismatch import mismatch_metrics, version_lags


class TrainState(Stateful):
    """Counters saved with every checkpoint."""

    def __init__(self) -> None:
        self.step = 0
        self.policy_version = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "policy_version": self.policy_version}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.policy_version = int(state_dict["policy_version"])


class AdapterSettings(Stateful):
    """The LoRA settings a checkpoint's adapters were trained with, saved beside them. Adapters loaded under other
    settings would be another policy without a word (alpha rescales every update, a dropped target drops its
    adapter), so loading them compares first and refuses (`check_loaded`)."""

    def __init__(self, lora: LoRAConfig) -> None:
        self.lora = lora
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.lora.rank, "alpha": float(self.lora.alpha),
                "target_modules": ",".join(sorted(self.lora.target_modules))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)  # compared by check_loaded, outside DCP (which reports any error as its own)

    def check_loaded(self) -> None:
        ours = self.state_dict()
        differ = [f"{k}={self.loaded[k]!r} there, {ours[k]!r} here" for k in ours if self.loaded[k] != ours[k]]
        if differ:
            raise CheckpointMismatch(f"trainer.lora differs from the settings the checkpoint's adapters were trained "
                                     f"with ({'; '.join(differ)}): set them as they were to resume")


class OptimizerState(Stateful):
    """torchtitan's optimizers in a checkpoint. Their `state_dict()` creates missing optimizer state with a
    zero-learning-rate step (torchtitan 0.3.0's `init_optim_state`), which counts as Adam's first step: saved before
    any training step, the live optimizer would then take its first real step with the second step's bias
    correction. Saved so, the step counts go back to 0: zero moments at step 0 are Adam's fresh state."""

    def __init__(self, optimizers: OptimizersContainer) -> None:
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        fresh = not any(optimizer.state for optimizer in self.optimizers)
        state = self.optimizers.state_dict()
        if fresh:
            for optimizer in self.optimizers:
                for param_state in optimizer.state.values():
                    if torch.is_tensor(param_state.get("step")):
                        param_state["step"].zero_()  # the saved dict holds these very tensors
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers.load_state_dict(state_dict)


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch with every tensor on `device`."""
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return TrainBatch(**{k: None if v is None else v.to(device) for k, v in values.items()})


class TitanTrainer:
    """Trains a policy on `TrainBatch`es with a loss from `losses`.

    With world_size > 1 the caller has initialized torch.distributed (gloo on CPU, nccl on GPU) and calls
    every method on every rank with the same arguments: each rank then works on its own data-parallel
    slice of the batch, and the collectives inside keep the ranks in step.

    Gradient accumulation is exact for any loss, including losses that normalize over the whole batch
    (a token mean, a sequence mean, a constant): the loss is evaluated once on the log-probs of the whole
    global batch, and its gradient with respect to those log-probs is back-propagated micro-batch by
    micro-batch. With more than one micro-batch per rank this costs one extra forward pass without grad.

    Dropout (LoRA's `dropout`) acts on the gradient pass only, the standard LoRA practice. Every pass that scores
    (`logprobs`, pi_old, `score_tokens`) runs without it, so a score is the policy itself; the recomputation of a
    micro-batch replays the random state of its first forward, so it draws the same masks and the accumulation
    stays exact. With dropout the batch is scored once before the first optimizer step (one extra forward pass
    without grad): pi_old and the mismatch metrics are the policy's, not one draw of its masks.
    """

    def __init__(self, config: TrainerConfig, *, rank: int = 0, world_size: int = 1) -> None:
        tp = config.tensor_parallel_degree
        if world_size % tp:
            raise ValueError(f"TrainerConfig.tensor_parallel_degree={tp}: must divide world_size={world_size}")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = local_device(config.device)
        self.loss_fn = get_loss(config.loss)
        self._needs_pi_old = uses_old_logprobs(config.loss_params)
        # The rollout correction's fields, for the mismatch metrics (what it masks and truncates).
        self._correction_params = {k: v for k, v in config.loss_params.items() if k in PI_OLD_PARAMS}
        self.model_path = resolve_model_path(config.model_path)
        self.parallel_dims = parallel_dims(world_size, tp)
        settings = ModelSettings(dtype=config.dtype, tensor_parallel_degree=tp,
                                 activation_checkpoint=config.activation_checkpoint)
        # model_args: torchtitan's model configuration (max_seq_len, vocab_size, enable_weight_tying).
        self.model, self.model_args, self.adapter = build_model(
            self.model_path, config.family, device=self.device, param_dtype=torch.float32,
            parallel_dims=self.parallel_dims, settings=settings, init_checkpoint=config.init_checkpoint,
            lora=config.lora)
        self.model.train()
        self.optimizers, self.lr_schedulers = self._build_optimizers()
        self.train_state = TrainState()
        self.dp = DataParallel.of(self.parallel_dims)
        # FSDP casts to the compute dtype itself; a single device needs autocast (torchtitan 0.2.0's choice).
        self._autocast = (contextlib.nullcontext() if config.dtype == "float32" or self.parallel_dims.fsdp_enabled
                          else torch.autocast(self.device.type, dtype=getattr(torch, config.dtype)))

    def _build_optimizers(self) -> tuple[OptimizersContainer, LRSchedulersContainer]:
        """torchtitan's AdamW over the parameters that require grad (with LoRA, the adapters alone) and its LR
        schedule: linear warmup, then constant or a decay to 0 at max_steps."""
        c = self.config
        adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                 optimizer_kwargs=dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                                       weight_decay=c.weight_decay))
        implementation = "fused" if self.device.type == "cuda" else "foreach"
        optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation=implementation).build(
            model_parts=[self.model])
        # decay_ratio=0: no decay phase (constant after warmup); None: decay from warmup to max_steps.
        schedule = LRSchedulersContainer.Config(warmup_steps=c.warmup_steps,
                                                decay_ratio=0.0 if c.lr_decay == "constant" else None,
                                                decay_type="linear" if c.lr_decay == "constant" else c.lr_decay)
        return optimizers, schedule.build(optimizers=optimizers, training_steps=c.max_steps)

    @property
    def step(self) -> int:
        return self.train_state.step

    @property
    def policy_version(self) -> int:
        return self.train_state.policy_version

    # -- forward passes ---------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, kept_token_ids: torch.Tensor | None = None, *,
                 with_entropy: bool, temperature: float | None = None, document_ids: torch.Tensor | None = None,
                 topk_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (differentiable when grad is on) and entropies (no grad) of input_ids[:, 1:]: [b, T-1]. With
        `document_ids` (packed rows) each token attends within its document only, under `_attention`. With
        `topk_ids` ([b, T-1, K]: the teacher's top-k, `TrainBatch.ref_topk_ids`) also the log-probs of those ids and
        of the rest of the vocabulary, [b, T-1, K+1] (differentiable; `actors.logprobs.bucket_logprobs`), else None."""
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        # Sequence parallelism splits positions evenly across TP ranks; right padding changes no earlier logit.
        pad = -inputs.shape[1] % self.parallel_dims.tp
        inputs = F.pad(inputs, (0, pad))
        masks = None
        if document_ids is not None:  # the padding is a document of its own
            masks = DocumentMask.of(F.pad(document_ids[:, :-1], (0, pad), value=-1).to(inputs.device))
        with self._autocast:
            logits = self.model(inputs, attention_masks=masks)
        if isinstance(logits, DTensor):  # TP shards the vocabulary; the log-probs need all of it on each rank
            logits = logits.full_tensor()
        logits = logits[:, : targets.shape[1]]
        # Under top-k/top-p the behaviour policy is the truncated distribution: renormalise over the same kept sets.
        temperature = self.config.temperature if temperature is None else temperature
        logprobs = token_logprobs(logits, targets, temperature, kept_token_ids)
        entropy = token_entropy(logits, temperature) if with_entropy else None
        topk = None
        if topk_ids is not None:
            topk = bucket_logprobs((logits.float() / temperature).log_softmax(-1), topk_ids.to(logits.device))
        return logprobs, entropy, topk

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """log pi_theta(input_ids[:, 1:]) at the current weights: [B, T-1] float32 on CPU, for the whole batch, at
        `temperature` (None: TrainerConfig.temperature)."""
        check_input_ids(batch.input_ids, self.model_args)
        return self._score(batch.input_ids.to(self.device), batch.kept_token_ids, temperature, batch.document_ids)

    @torch.no_grad()
    def score_tokens(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Teacher-forced log pi(token_ids | prompt_ids) at temperature 1 over the full vocabulary: the weight-sync
        canary's trainer side (every rank calls it; each scores one copy of the row)."""
        input_ids = torch.tensor([list(prompt_ids) + list(token_ids)] * self.dp.degree)
        check_input_ids(input_ids, self.model_args)
        with without_dropout(self.model):
            scored = score_rows(lambda rows: self._forward(rows, with_entropy=False, temperature=1.0)[0],
                                input_ids.to(self.device), 1, self.dp)
        return scored[0, len(prompt_ids) - 1 :].tolist()

    @torch.no_grad()
    def _score(self, input_ids: torch.Tensor, kept_token_ids: torch.Tensor | None = None,
               temperature: float | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """log pi_theta of the whole batch without dropout: [B, T-1] on CPU."""
        kept = None if kept_token_ids is None else kept_token_ids.to(input_ids.device)
        # score_rows slices one [B, ...] tensor by rows: a packed batch's document ids go along as a second channel.
        rows = input_ids if document_ids is None else torch.stack([input_ids, document_ids.to(input_ids)], 1)

        def score(rows: torch.Tensor, kept_rows: torch.Tensor | None = None) -> torch.Tensor:
            ids, documents = (rows, None) if document_ids is None else (rows[:, 0], rows[:, 1])
            return self._forward(ids, kept_rows, with_entropy=False, temperature=temperature,
                                 document_ids=documents)[0]

        with without_dropout(self.model):
            return score_rows(score, rows, self.config.micro_batch_size, self.dp, kept)

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`minibatches` optimizer steps, one per contiguous slice of the batch (every rank passes the same
        batch), as one policy version (`policy_version` after it); returns the slices' metrics averaged and the
        batch's mismatch metrics (losses.mismatch). The LR schedule advances once."""
        if self.step >= self.config.max_steps:
            raise RuntimeError(f"train_step: step {self.step} reached TrainerConfig.max_steps={self.config.max_steps}")
        started = time.perf_counter()
        check_input_ids(batch.input_ids, self.model_args)
        count, rows = self.config.minibatches, batch.num_sequences
        if rows % (count * self.dp.degree):
            raise ValueError(f"batch of {rows} sequences: must be a multiple of TrainerConfig.minibatches={count} "
                             f"x the data-parallel degree {self.dp.degree}")
        lags = version_lags(batch, self.policy_version)
        batch = to_device(batch, self.device)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        # The weights before the first optimizer step (pi_old), scored before it without dropout, rows `first` on.
        # Without dropout the first slice's training forward is pi_old itself, so only the later slices are scored
        # (none with one minibatch); with dropout the whole batch is.
        size = rows // count
        scored, first = None, 0
        if draws_dropout(self.model):
            scored = self._score(batch.input_ids, batch.kept_token_ids, document_ids=batch.document_ids).to(self.device)
        elif self._needs_pi_old and count > 1:
            later, first = batch.slice(size, rows), size
            scored = self._score(later.input_ids, later.kept_token_ids, document_ids=later.document_ids).to(self.device)
        # Advantages come with the episodes, so a slice needs no whole groups; after the first slice the
        # samples are off-policy and the loss's clip bounds the update (around pi_old with a rollout correction).
        per_slice, train_logprobs = [], []
        for s in range(0, rows, size):
            old_slice = (scored[s - first : s - first + size]
                         if scored is not None and s >= first and self._needs_pi_old else None)
            metrics, logprobs = self._optimizer_step(batch.slice(s, s + size), old_slice)
            per_slice.append(metrics)
            train_logprobs.append(logprobs if scored is None or s < first else scored[s - first : s - first + size])
        self.lr_schedulers.step()
        # Unless pi_old was scored, only the first slice's log-probs precede every optimizer step: later slices are
        # scored after the earlier slices' updates, and that drift would read as a generator/trainer mismatch.
        before = rows if scored is not None else size
        mismatch = mismatch_metrics(torch.cat(train_logprobs)[:before], batch.slice(0, before), lags[:before],
                                    **self._correction_params)
        self.train_state.step += 1
        self.train_state.policy_version += 1
        metrics = {key: sum(m[key] for m in per_slice) / count for key in per_slice[0]}
        metrics.update(mismatch, lr=lr, tokens_per_second=batch.input_ids.numel() / (time.perf_counter() - started))
        return metrics

    def accumulate_gradients(
        self, batch: TrainBatch, loss_fn: Any, loss_params: dict[str, Any], *,
        old_logprobs: torch.Tensor | None = None, old_is_current: bool = False, with_entropy: bool = False,
        temperature: float | None = None
    ) -> tuple[LossOutput, torch.Tensor, torch.Tensor | None]:
        """Add d(loss)/d(params) of the whole batch to the parameters' gradients, micro-batch by micro-batch.

        `old_logprobs` (pi_old, [B, T-1]) go to the loss when given; `old_is_current`: the weights have not
        stepped on this batch yet, so pi_old is this forward's own log-probs (exactly; with dropout, the batch
        scored without it). `temperature`: the one the batch's behaviour log-probs are at (None:
        TrainerConfig.temperature). Returns the loss output, the batch's log-probs [B, T-1] (detached) and, if
        asked, the token entropies.
        """
        start, stop = self.dp.rows(batch.num_sequences)
        size = self.config.micro_batch_size
        micro = [batch.slice(s, min(s + size, stop)) for s in range(start, stop, size)]
        # Log-probs of this rank's rows; with one micro-batch keep its graph for the backward pass. Each
        # micro-batch's random state is kept so that its recomputation below draws the same dropout masks.
        keep_graph = len(micro) == 1
        # A loss that takes `topk_logprobs` (losses.distill's kl="reverse" / "forward") gets the student's log-probs of
        # the teacher's top-k ids when the batch carries them: a second input the gradient flows back through.
        with_topk = batch.ref_topk_ids is not None and "topk_logprobs" in inspect.signature(loss_fn).parameters
        parts, rng_states = [], []
        with torch.set_grad_enabled(keep_graph):
            for mb in micro:
                rng_states.append(_rng_state(self.device))
                parts.append(self._forward(mb.input_ids, mb.kept_token_ids, with_entropy=with_entropy,
                                           temperature=temperature, document_ids=mb.document_ids,
                                           topk_ids=mb.ref_topk_ids if with_topk else None))
        local_logprobs = torch.cat([lp for lp, _, _ in parts])
        entropy = self.dp.gather_rows(torch.cat([e for _, e, _ in parts])) if with_entropy else None
        logprobs = self.dp.gather_rows(local_logprobs.detach()).requires_grad_()
        local_topk = torch.cat([topk for _, _, topk in parts]) if with_topk else None
        inputs = {"topk_logprobs": self.dp.gather_rows(local_topk.detach()).requires_grad_()} if with_topk else {}

        if old_is_current:
            old_logprobs = (self._score(batch.input_ids, batch.kept_token_ids, temperature,
                                        batch.document_ids).to(self.device)
                            if draws_dropout(self.model) else logprobs.detach())
        pi_old = {} if old_logprobs is None else {"old_logprobs": old_logprobs}
        out: LossOutput = loss_fn(logprobs, batch, **pi_old, **inputs, **loss_params)
        if not out.loss.requires_grad:
            name = getattr(loss_fn, "__name__", repr(loss_fn))
            raise ValueError(f"loss {name!r} returned a loss that does not depend on the log-probs")
        leaves = [logprobs, *inputs.values()]
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
        # Each rank's share of the gradient is exact, and torchtitan 0.3.0's FSDP sums them over the data-parallel
        # ranks (its apply_fsdp_to_decoder sets the divide factor to 1; 0.2.0 averaged, which forge undid here).
        local_grads = [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, grads)]
        local_grads = [grad[start : start + local_logprobs.shape[0]] for grad in local_grads]
        if keep_graph:
            torch.autograd.backward([local_logprobs, *([local_topk] if with_topk else [])], local_grads)
        else:
            offset = 0
            for mb, rng in zip(micro, rng_states):
                _set_rng_state(self.device, rng)
                mb_logprobs, _, mb_topk = self._forward(mb.input_ids, mb.kept_token_ids, with_entropy=False,
                                                        temperature=temperature, document_ids=mb.document_ids,
                                                        topk_ids=mb.ref_topk_ids if with_topk else None)
                rows = slice(offset, offset + mb.num_sequences)
                torch.autograd.backward([mb_logprobs, *([mb_topk] if with_topk else [])],
                                        [grad[rows] for grad in local_grads])
                offset += mb.num_sequences
        return out, logprobs.detach(), entropy

    def _optimizer_step(self, batch: TrainBatch, old_logprobs: torch.Tensor | None) -> tuple[dict[str, float],
                                                                                          torch.Tensor]:
        """One optimizer step on the whole (mini)batch; each rank back-propagates its own rows. Returns its
        metrics and the log-probs it was scored with (before the step). Without `old_logprobs` a loss that needs
        pi_old gets these log-probs: the weights have not stepped on this batch yet (one minibatch)."""
        self.optimizers.zero_grad()
        old_is_current = old_logprobs is None and self._needs_pi_old
        out, logprobs, entropy = self.accumulate_gradients(batch, self.loss_fn, self.config.loss_params,
                                                           old_logprobs=old_logprobs, old_is_current=old_is_current,
                                                           with_entropy=True)
        grad_norm = titan_dist.clip_grad_norm_(list(self.model.parameters()), self.config.max_grad_norm, foreach=True)
        self.optimizers.step()
        mask = batch.response_mask
        metrics = {
            **out.metrics,
            "loss": out.loss.item(),
            "grad_norm": grad_norm.item(),
            "entropy": ((entropy * mask).sum() / mask.sum().clamp(min=1)).item(),
        }
        return metrics, logprobs

    # -- weights in Hugging Face names --------------------------------------------------------------

    def hf_state_dict_shards(self) -> dict[str, torch.Tensor]:
        """The live parameters in HF names without a copy: DTensors (this rank's shard and its placement)
        under FSDP/TP, plain tensors on one rank. Cheap for qwen3, whose names map one to one; llama3's
        adapter permutes q and k, which redistributes those DTensors (a collective).

        With LoRA, what a version publishes: the adapter alone in peft's HF names, B multiplied by alpha / rank
        (a copy of B), so an engine merges `W + B @ A` knowing nothing of the LoRA config."""
        state = get_model_state_dict(self.model)
        if self.config.lora is not None:
            return lora.to_peft_names(lora.adapter_state(state), self.adapter, scaling=self.config.lora.scaling)
        # A tied lm_head shares the embedding's storage: the adapter leaves it out, as HF checkpoints do.
        return self.adapter.to_hf(state)

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A snapshot of the full weights in HF names, cast to `dtype` (shard by shard, before gathering) when
        given, on rank 0; the other ranks get an empty dict. Under FSDP/TP a collective: call it on every rank."""
        return _gathered(self.hf_state_dict_shards(), dtype)

    def export_hf(self, path: str | os.PathLike) -> str:
        """Write a HF checkpoint folder that transformers loads: config.json and tokenizer files from the
        source checkpoint, model.safetensors in the source's dtype. With LoRA, a peft adapter folder instead
        (adapter_config.json, adapter_model.safetensors) that `PeftModel.from_pretrained(base, path)` loads.
        Call on every rank; rank 0 writes."""
        dtype = checkpoint.source_dtype(self.model_path)
        if self.config.lora is None:
            state = self.hf_state_dict(dtype)
            return checkpoint.export_hf(state, self.model_path, Path(path), rank=self.rank, world_size=self.world_size)
        adapter = _gathered(lora.to_peft_names(lora.adapter_state(get_model_state_dict(self.model)), self.adapter), dtype)
        if self.rank == 0:
            lora.export_peft(adapter, self.config.lora, str(self.model_path), Path(path))
        if self.world_size > 1:
            torch.distributed.barrier()
        return str(path)

    # -- checkpoints ------------------------------------------------------------------------------

    def _checkpoint_states(self) -> dict[str, Any]:
        # torchtitan's CheckpointManager layout: model keys at the top level, then the stateful parts.
        # Fresh each time: FSDP re-allocates unevenly sharded parameters at its first forward pass, so a
        # state dict taken earlier (torchtitan's ModelWrapper caches one) can hold stale shards.
        # With LoRA the base is the frozen source checkpoint: only the adapters are saved.
        model = get_model_state_dict(self.model)
        parts = {"optimizer": OptimizerState(self.optimizers), "lr_scheduler": self.lr_schedulers,
                 "train_state": self.train_state}
        if self.config.lora is not None:
            model = lora.adapter_state(model)
            parts["lora"] = AdapterSettings(self.config.lora)
        return {**model, **parts}

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Save model, optimizer, LR schedule, step and policy version with DCP (each rank writes its
        shards) to `path`, plus the size and CRC32 of every file. `path` is either absent or complete. Call on
        every rank; the job decides where (apps.grpo: `checkpoint.folder/step_NNNNNN/trainer`)."""
        states = self._checkpoint_states()
        return checkpoint.save(states, Path(path), rank=self.rank, world_size=self.world_size)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore everything `save_checkpoint` saved; the next step is the one the saved run took next.
        Raises FileNotFoundError for an incomplete folder, RuntimeError for a corrupt one and CheckpointMismatch
        (a RuntimeError too) for LoRA adapters saved under other settings. A checkpoint written by forge on torchtitan
        0.2.0 (the old module names) loads through the key map of actors.checkpoint (`in_checkpoint_names`)."""
        if self.config.lora is not None:  # the adapters' settings first: refused before any tensor loads
            settings = AdapterSettings(self.config.lora)
            checkpoint.load({"lora": settings}, Path(path), rank=self.rank, world_size=self.world_size)
            settings.check_loaded()
        states = self._checkpoint_states()
        renamed, _ = checkpoint.in_checkpoint_names(states, Path(path))
        checkpoint.load(renamed, Path(path), rank=self.rank, world_size=self.world_size)
        # DCP loaded into the tensors themselves, which `states` holds under the model's own names.
        set_model_state_dict(self.model, {k: v for k, v in states.items() if checkpoint.is_model_key(k)},
                             options=StateDictOptions(strict=self.config.lora is None))


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state dropout draws from on `device` (the CPU generator's, and the device's own on CUDA)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _gathered(shards: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Full tensors on rank 0 (cast shard by shard to `dtype` first, when given); {} on the other ranks."""
    full = {}
    for name, shard in shards.items():
        tensor = gather_to_rank0(shard.detach().to(dtype or shard.dtype, copy=True))
        if tensor is not None:
            full[name] = tensor
    return full
