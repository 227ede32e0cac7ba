"""The trainer's configuration, checked when it is built (before any process starts)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from actors.lora_config import LoRAConfig, check_lora_for_model, local_hf_config
from actors.model_config import ModelConfig, is_int, is_number, require_field
from losses.rules import HYPERPARAM_RULES, check_hyperparams
from losses.registry import REGISTERED_LOSSES, SUPPLIED_BY_TRAINER, SUPPLIED_IF_TAKEN, check_loss_name

LR_DECAYS = ("constant", "linear", "cosine")
ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
PUBLISH_DTYPES = ("float32", "bfloat16", "float16")  # what a generator may run in


@dataclass
class TrainerConfig(ModelConfig):
    """The TorchTitan trainer: optimizer, schedule, loss, parallelism, LoRA."""

    lr: float = 1e-6
    """AdamW learning rate (TorchTitan's builder)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup steps."""
    lr_decay: str = "constant"
    """After the warmup: constant, linear or cosine (to 0 at `max_steps`)."""
    max_steps: int = 1_000_000
    """The LR schedule's length; training past it is an error (at least `steps`)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (inf: report the norm, never clip)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on each rank; micro-batches give the full-batch step (tested with
    DAPO's token-mean loss)."""
    minibatches: int = 1
    """Optimizer steps per training step, each on 1/minibatches of the batch's rows (one published version)."""
    loss: Any = "grpo"
    """grpo, dapo, gspo, cispo, dr_grpo, distill, or `package.module:function` (dr_grpo needs
    `rollout.normalize_advantages: false`; distill needs `teacher.model`)."""
    loss_params: dict[str, Any] = field(default_factory=dict)
    """The loss's hyperparameters (e.g. `clip_eps`, `kl_coef`, `kl_estimator`) and the rollout corrections `tis_cap`,
    `token_mask_band`, `seq_mask_band` (docs/off_policy.md)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (GPUs)."""
    activation_checkpoint: str = "none"
    """TorchTitan's activation checkpointing: none, selective (per op: torchtitan 0.3's SelectiveAC; 0.2's was every
    second block) or full (GPUs)."""
    torch_threads: int = 0
    """CPU threads per trainer process on device=cpu (0: torch's default, one per core; the tiny configs: 1, the
    generator has the other core)."""
    publish_dtype: str | None = None
    """The dtype published weights are cast to: the generator's (apps set it from `generator.dtype`); null:
    `dtype`."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on a frozen base (null: full fine-tuning); publishes and exports the adapter only
    (docs/lora.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_field(self, "lr", is_number(self.lr) and self.lr > 0, "a number > 0")
        betas = self.betas
        valid_betas = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            is_number(b) and 0 <= b < 1 for b in betas)
        require_field(self, "betas", valid_betas, "two numbers in [0, 1)")
        self.betas = tuple(betas)
        require_field(self, "eps", is_number(self.eps) and self.eps > 0, "a number > 0")
        require_field(self, "weight_decay", is_number(self.weight_decay) and self.weight_decay >= 0, "a number >= 0")
        require_field(self, "max_steps", is_int(self.max_steps) and self.max_steps >= 1, "an int >= 1")
        require_field(self, "warmup_steps", is_int(self.warmup_steps) and 0 <= self.warmup_steps <= self.max_steps,
                      f"an int in [0, max_steps={self.max_steps}]")
        require_field(self, "lr_decay", self.lr_decay in LR_DECAYS, f"one of {', '.join(LR_DECAYS)}")
        require_field(self, "max_grad_norm", is_number(self.max_grad_norm) and self.max_grad_norm > 0,
                      "a number > 0 (inf: never clip)")
        require_field(self, "torch_threads", is_int(self.torch_threads) and self.torch_threads >= 0, "an int >= 0")
        for name in ("micro_batch_size", "minibatches", "tensor_parallel_degree"):
            require_field(self, name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        require_field(self, "activation_checkpoint", self.activation_checkpoint in ACTIVATION_CHECKPOINT_MODES,
                      f"one of {', '.join(ACTIVATION_CHECKPOINT_MODES)}")
        require_field(self, "publish_dtype", self.publish_dtype is None or self.publish_dtype in PUBLISH_DTYPES,
                      f"None (the trainer's dtype) or one of {', '.join(PUBLISH_DTYPES)}")
        self.publish_dtype = self.publish_dtype or self.dtype
        require_field(self, "loss_params", isinstance(self.loss_params, dict), "a dict of the loss's hyperparameters")
        _check_loss(self.loss, self.loss_params)
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        require_field(self, "lora", self.lora is None or isinstance(self.lora, LoRAConfig),
                      "None or {rank, alpha, dropout, target_modules}")
        if self.lora is not None:
            check_lora_for_model(self.lora, self.family, local_hf_config(self.model_path), field_prefix="TrainerConfig.lora",
                                 tensor_parallel_degree=self.tensor_parallel_degree)
            # torchtitan recomputes checkpointed blocks without their random state (preserve_rng_state=False): the
            # backward pass would differentiate other dropout masks than the forward pass the loss was computed on.
            require_field(self, "activation_checkpoint", self.lora.dropout == 0 or self.activation_checkpoint == "none",
                          f"'none' with lora.dropout={self.lora.dropout} (torchtitan's activation checkpointing "
                          "recomputes dropout with new masks), or set lora.dropout=0")


def _check_loss(loss: Any, loss_params: dict[str, Any]) -> None:
    """The loss exists and takes `loss_params`, in range. A registered loss is checked without importing it (torch);
    a user's loss ("package.module:function" or a callable) is imported: its signature says what it takes."""
    if isinstance(loss, str):
        check_loss_name(loss)  # an unknown name is refused without importing the losses
    if loss in REGISTERED_LOSSES:
        name, taken = loss, REGISTERED_LOSSES[loss].hyperparams
    else:
        from losses import get_loss  # raises a ValueError naming the loss when it cannot be imported

        loss_fn = get_loss(loss)
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        parameters = inspect.signature(loss_fn).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return
        taken = ({p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL} - SUPPLIED_BY_TRAINER
                 - SUPPLIED_IF_TAKEN)
    unknown = sorted(set(loss_params) - taken)
    if unknown:
        raise ValueError(f"TrainerConfig.loss_params={loss_params!r}: {unknown} not taken by loss {name!r}; "
                         f"allowed: {sorted(taken)}")
    # The shared hyperparameters' ranges, checked now rather than at the first training step.
    checked = {k: v for k, v in loss_params.items() if k in HYPERPARAM_RULES}
    check_hyperparams(f"TrainerConfig.loss_params ({name})", **checked)


class CheckpointMismatch(RuntimeError):
    """An intact checkpoint that this trainer's configuration cannot take (the settings it was saved under differ):
    resuming it needs those settings back, not another checkpoint."""
