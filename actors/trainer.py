"""The policy trainer: a TorchTitan model trained on RL batches, FSDP2-sharded across data-parallel ranks.

A plain class; the trainer actor wraps it. The model, its parallelization, the optimizer, the LR schedule,
the Hugging Face name mapping and the checkpoint state containers are torchtitan's own components. What
this module adds is what RL needs on top of them: model arguments read from a checkpoint's
`config.json` (so one code path loads a tiny test model and Qwen3-8B), a policy loss over per-token
log-probs with exact gradient accumulation, and weights in Hugging Face names for publishing.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as titan_dist
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols import BaseModelArgs, BaseStateDictAdapter
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import set_default_dtype

from forge.actor import ForgeActor, endpoint
from forge.distributed import init_from_environment
from forge.types import Episode, TrainBatch
from forge.weight_store import WeightStore
from losses import LossOutput, get_loss
from losses.terms import HYPERPARAM_RULES, check_hyperparams

FAMILIES = ("qwen3", "llama3")
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
LR_DECAYS = ("constant", "linear", "cosine")
ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
# The HF `model_type` each family's torchtitan model and state-dict adapter reproduce.
HF_MODEL_TYPES = {"qwen3": "qwen3", "llama3": "llama"}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
CHECKSUMS_FILE = "checksums.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_field(config: object, name: str, ok: bool, allowed: str) -> None:
    """Raise a ValueError naming the config class, the field, its value and what is allowed."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: must be {allowed}")


def check_model_fields(config: Any) -> None:
    """Validate the fields the trainer and the reference model share: where the weights come from and how
    they run (model_path, family, init_checkpoint, dtype, device, temperature)."""
    path = config.model_path
    is_local = isinstance(path, str) and Path(path).exists()
    has_config = Path(path, "config.json").is_file() if is_local else bool(_HUB_ID.match(str(path)))
    is_valid_path = isinstance(path, str) and has_config
    require_field(config, "model_path", is_valid_path,
                  "a Hugging Face checkpoint folder with config.json, or a hub id 'org/name'")
    require_field(config, "family", config.family in FAMILIES, f"one of {', '.join(FAMILIES)}")
    init = config.init_checkpoint
    require_field(config, "init_checkpoint", init is None or Path(init, ".metadata").is_file(),
                  "None or a torchtitan/DCP checkpoint folder (with .metadata)")
    require_field(config, "dtype", config.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
    require_field(config, "device", config.device in DEVICES, f"one of {', '.join(DEVICES)}")
    require_field(config, "temperature", _is_number(config.temperature) and config.temperature > 0,
                  "a number > 0 (the generator's sampling temperature)")


@dataclass
class TrainerConfig:
    model_path: str  # HF checkpoint folder or hub id: architecture, tokenizer and (by default) weights
    family: str = "qwen3"  # torchtitan train spec of that checkpoint: qwen3 | llama3
    init_checkpoint: str | None = None  # a torchtitan/DCP checkpoint to take the initial weights from
    dtype: str = "float32"  # compute dtype; parameters and optimizer state stay float32
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_decay: str = "constant"  # after warmup: constant | linear | cosine (to 0 at max_steps)
    max_steps: int = 1_000_000  # the LR schedule's length; training past it is an error
    max_grad_norm: float = 1.0  # float("inf"): report the norm, never clip
    micro_batch_size: int = 8  # sequences per forward/backward pass on each rank
    minibatches: int = 1  # optimizer steps per train_step, each on 1/minibatches of the batch's rows
    temperature: float = 1.0  # the generator's sampling temperature: log-probs are of logits / temperature
    loss: Any = "grpo"  # a name in losses.LOSSES, a callable, or "package.module:function"
    loss_params: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_degree: int = 1
    activation_checkpoint: str = "none"  # torchtitan's activation checkpointing: none | selective | full
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0  # save into checkpoint_dir every N steps; 0: only when asked
    torch_threads: int = 0  # CPU threads per trainer process on device=cpu (0 = torch's default, one per core)

    def __post_init__(self) -> None:
        check_model_fields(self)
        require_field(self, "lr", _is_number(self.lr) and self.lr > 0, "a number > 0")
        betas = self.betas
        valid_betas = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            _is_number(b) and 0 <= b < 1 for b in betas)
        require_field(self, "betas", valid_betas, "two numbers in [0, 1)")
        self.betas = tuple(betas)
        require_field(self, "eps", _is_number(self.eps) and self.eps > 0, "a number > 0")
        require_field(self, "weight_decay", _is_number(self.weight_decay) and self.weight_decay >= 0,
                      "a number >= 0")
        require_field(self, "max_steps", _is_int(self.max_steps) and self.max_steps >= 1, "an int >= 1")
        require_field(self, "warmup_steps", _is_int(self.warmup_steps) and 0 <= self.warmup_steps <= self.max_steps,
                      f"an int in [0, max_steps={self.max_steps}]")
        require_field(self, "lr_decay", self.lr_decay in LR_DECAYS, f"one of {', '.join(LR_DECAYS)}")
        require_field(self, "max_grad_norm", _is_number(self.max_grad_norm) and self.max_grad_norm > 0,
                      "a number > 0 (inf: never clip)")
        require_field(self, "torch_threads", _is_int(self.torch_threads) and self.torch_threads >= 0, "an int >= 0")
        for name in ("micro_batch_size", "minibatches", "tensor_parallel_degree"):
            require_field(self, name, _is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        require_field(self, "activation_checkpoint", self.activation_checkpoint in ACTIVATION_CHECKPOINT_MODES,
                      f"one of {', '.join(ACTIVATION_CHECKPOINT_MODES)}")
        require_field(self, "checkpoint_interval", _is_int(self.checkpoint_interval) and self.checkpoint_interval >= 0,
                      "an int >= 0")
        require_field(self, "checkpoint_dir", self.checkpoint_dir is not None or self.checkpoint_interval == 0,
                      f"a folder when checkpoint_interval={self.checkpoint_interval} > 0")
        require_field(self, "loss_params", isinstance(self.loss_params, dict), "a dict of the loss's hyperparameters")
        loss_fn = get_loss(self.loss)  # raises a ValueError naming the loss when it is unknown
        _check_loss_params(loss_fn, self.loss_params)


def _check_loss_params(loss_fn: Any, loss_params: dict[str, Any]) -> None:
    parameters = inspect.signature(loss_fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    taken = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    taken -= {"logprobs", "batch", "old_logprobs"}  # supplied by the trainer
    unknown = sorted(set(loss_params) - taken)
    if unknown:
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        raise ValueError(f"TrainerConfig.loss_params={loss_params!r}: {unknown} not taken by loss {name!r}; "
                         f"allowed: {sorted(taken)}")
    # The shared hyperparameters' ranges, checked now rather than at the first training step.
    checked = {k: v for k, v in loss_params.items() if k in HYPERPARAM_RULES}
    check_hyperparams(f"TrainerConfig.loss_params ({getattr(loss_fn, '__name__', 'loss')})", **checked)


# ---------------------------------------------------------------------------------------------------
# Building the model


def model_args_from_hf(family: str, hf_config: dict[str, Any]) -> BaseModelArgs:
    """torchtitan model arguments equivalent to a Hugging Face `config.json` of that family."""
    model_type = hf_config.get("model_type")
    if model_type != HF_MODEL_TYPES[family]:
        raise ValueError(f"config.json model_type={model_type!r} is not family {family!r}; "
                         f"that family needs model_type {HF_MODEL_TYPES[family]!r}")
    for key, supported in (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False)):
        if hf_config.get(key, supported) != supported:
            raise ValueError(f"config.json {key}={hf_config[key]!r}: torchtitan's {family} supports only {supported}")
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    common = dict(
        dim=dim,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        vocab_size=hf_config["vocab_size"],
        norm_eps=hf_config["rms_norm_eps"],
        rope_theta=hf_config["rope_theta"],
        max_seq_len=hf_config["max_position_embeddings"],
    )
    eos_id = hf_config.get("eos_token_id")
    if _is_int(eos_id):
        common["eos_id"] = eos_id
    tied = bool(hf_config.get("tie_word_embeddings", False))
    rope_scaling = hf_config.get("rope_scaling")
    if family == "qwen3":
        if rope_scaling is not None:
            raise ValueError(f"config.json rope_scaling={rope_scaling!r}: torchtitan's qwen3 supports only None")
        return Qwen3ModelArgs(**common, head_dim=head_dim, hidden_dim=hf_config["intermediate_size"],
                              qk_norm=True, enable_weight_tying=tied)
    if tied:
        raise ValueError("config.json tie_word_embeddings=True: torchtitan's llama3 has no weight tying")
    if head_dim != dim // n_heads:
        raise ValueError(f"config.json head_dim={head_dim}: torchtitan's llama3 needs hidden_size / "
                         f"num_attention_heads = {dim // n_heads}")
    # torchtitan sizes the SwiGLU layer as multiple_of * ceil(int(multiplier * int(8 dim / 3)) / multiple_of);
    # multiple_of = intermediate_size makes that exactly intermediate_size whatever the float rounding.
    intermediate = hf_config["intermediate_size"]
    ffn = dict(multiple_of=intermediate, ffn_dim_multiplier=intermediate / int(8 * dim / 3))
    if rope_scaling is None:
        rope = RoPEScalingArgs(scaling_factor=1.0)  # torchtitan always applies Llama 3.1 scaling; 1 = none
    elif rope_scaling.get("rope_type") == "llama3":
        rope = RoPEScalingArgs(
            scaling_factor=rope_scaling["factor"],
            low_freq_factor=rope_scaling["low_freq_factor"],
            high_freq_factor=rope_scaling["high_freq_factor"],
            original_max_position_embeddings=rope_scaling["original_max_position_embeddings"],
        )
    else:
        raise ValueError(f"config.json rope_scaling={rope_scaling!r}: torchtitan's llama3 supports None or "
                         "rope_type 'llama3'")
    return TransformerModelArgs(**common, **ffn, rope_scaling_args=rope)


def resolve_model_path(model_path: str) -> Path:
    """A local checkpoint folder as is; a hub id downloaded (config, tokenizer, safetensors only)."""
    if Path(model_path).exists():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    return Path(snapshot_download(model_path, allow_patterns=patterns))


def device_for(device_type: str) -> torch.device:
    """This rank's device: on CUDA the one LOCAL_RANK names (the launcher's convention)."""
    if device_type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device_type!r}: CUDA is not available on this host; use 'cpu'")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def build_job_config(*, dtype: str, tensor_parallel_degree: int = 1, activation_checkpoint: str = "none") -> JobConfig:
    """The torchtitan job settings its parallelize functions read (`build_model` sets training.seq_len)."""
    job = JobConfig()
    job.parallelism.tensor_parallel_degree = tensor_parallel_degree
    job.parallelism.disable_loss_parallel = True  # the trainer needs whole-vocabulary logits on each rank
    job.training.mixed_precision_param = dtype
    job.activation_checkpoint.mode = activation_checkpoint
    return job


def build_model(
    model_path: Path,
    family: str,
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    init_checkpoint: str | None = None,
) -> tuple[nn.Module, BaseModelArgs, BaseStateDictAdapter]:
    """The family's torchtitan model for a checkpoint: built on meta, parallelized (FSDP2, TP) when there is
    more than one rank, materialized on `device`, and loaded from the HF safetensors (or `init_checkpoint`)."""
    hf_config = json.loads((model_path / "config.json").read_text())
    model_args = model_args_from_hf(family, hf_config)
    spec = get_train_spec(family)
    with torch.device("meta"), set_default_dtype(param_dtype):
        model = spec.model_cls(model_args)
    tied = getattr(model_args, "enable_weight_tying", False)
    if tied and parallel_dims.world_size > 1:
        # parallelize_fn ties on the meta device and the tie does not survive materialization
        # (pytorch/torchtitan#2252): the output layer would train as a separate, stale copy.
        raise ValueError(f"config.json tie_word_embeddings=True with world_size={parallel_dims.world_size}: "
                         "torchtitan 0.2.0 cannot shard tied embeddings; use one rank or an untied checkpoint")
    if parallel_dims.world_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"world_size={parallel_dims.world_size}: initialize torch.distributed first")
    if parallel_dims.world_size > 1:
        # parallelize_fn asserts seq_len is a multiple of 2 * TP; it bounds nothing at run time.
        job_config.training.seq_len = model_args.max_seq_len - model_args.max_seq_len % (2 * parallel_dims.tp)
        # torchtitan picks its device type at import and falls back to "cuda" on a host without GPUs;
        # the mesh it builds for the parallelisms must be on this trainer's device type.
        titan_parallel_dims.device_type = device.type
        model = spec.parallelize_fn(model, parallel_dims, job_config)
        model.to_empty(device=device)
    else:
        model.to_empty(device=device)
        if tied:  # after materialization, which would untie them
            model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # only to materialize buffers; the weights are loaded next
    adapter = spec.state_dict_adapter(model_args, None)
    model_state = get_model_state_dict(model)
    # One rank reads alone even when the process has a process group (for other work) of several ranks.
    no_dist = parallel_dims.world_size == 1
    if init_checkpoint is not None:  # torchtitan's layout: the model's keys at the top level
        dcp.load(model_state, checkpoint_id=init_checkpoint, no_dist=no_dist)
    else:
        # A tied checkpoint has no lm_head.weight: the tied output shares the embedding's storage.
        hf_state = adapter.to_hf({k: v for k, v in model_state.items() if not (tied and k == "output.weight")})
        dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(model_path)), no_dist=no_dist)
        model_state = adapter.from_hf(hf_state)
    # dcp.load wrote into the parameters unless the adapter made copies (llama3 permutes q and k): copy back.
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=False))
    return model, model_args, adapter


# ---------------------------------------------------------------------------------------------------
# Per-token quantities


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


def data_parallel_rank(parallel_dims: ParallelDims) -> tuple[int, int, dist.ProcessGroup | None]:
    """(degree, rank, process group) of the data-parallel dimension; (1, 0, None) without one."""
    if not parallel_dims.dp_enabled:
        return 1, 0, None
    mesh = parallel_dims.world_mesh["dp"]
    return mesh.size(), mesh.get_local_rank(), mesh.get_group()


def data_parallel_rows(num_rows: int, degree: int, rank: int) -> tuple[int, int]:
    """This rank's rows [start, stop) of a batch every data-parallel rank holds in full."""
    if num_rows % degree:
        raise ValueError(f"batch of {num_rows} sequences: must be a multiple of the data-parallel degree {degree}")
    per_rank = num_rows // degree
    return rank * per_rank, (rank + 1) * per_rank


def gather_rows(local: torch.Tensor, degree: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every data-parallel rank's rows, in rank order."""
    if degree == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(degree)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------------
# The trainer


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


class TitanTrainer:
    """Trains a policy on `TrainBatch`es with a loss from `losses`.

    With world_size > 1 the caller has initialized torch.distributed (gloo on CPU, nccl on GPU) and calls
    every method on every rank with the same arguments: each rank then works on its own data-parallel
    slice of the batch, and the collectives inside keep the ranks in step.

    Gradient accumulation is exact for any loss, including losses that normalize over the whole batch
    (a token mean, a sequence mean, a constant): the loss is evaluated once on the log-probs of the whole
    global batch, and its gradient with respect to those log-probs is back-propagated micro-batch by
    micro-batch. With more than one micro-batch per rank this costs one extra forward pass without grad.
    """

    def __init__(self, config: TrainerConfig, *, rank: int = 0, world_size: int = 1) -> None:
        tp = config.tensor_parallel_degree
        if world_size % tp:
            raise ValueError(f"TrainerConfig.tensor_parallel_degree={tp}: must divide world_size={world_size}")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = device_for(config.device)
        self.loss_fn = get_loss(config.loss)
        self.model_path = resolve_model_path(config.model_path)
        self.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, etp=1,
                                          world_size=world_size)
        self.hf_config = json.loads((self.model_path / "config.json").read_text())
        job = build_job_config(dtype=config.dtype, tensor_parallel_degree=tp,
                               activation_checkpoint=config.activation_checkpoint)
        self._set_optimizer_config(job)
        self.model, self.model_args, self.adapter = build_model(
            self.model_path, config.family, device=self.device, param_dtype=torch.float32,
            parallel_dims=self.parallel_dims, job_config=job, init_checkpoint=config.init_checkpoint)
        self.model.train()
        spec = get_train_spec(config.family)
        self.optimizers = spec.build_optimizers_fn([self.model], job.optimizer, self.parallel_dims)
        self.lr_schedulers = spec.build_lr_schedulers_fn(self.optimizers, job.lr_scheduler, job.training.steps)
        self.train_state = TrainState()
        self.dp_degree, self.dp_rank, self.dp_group = data_parallel_rank(self.parallel_dims)
        # FSDP casts to the compute dtype itself; a single device needs autocast (torchtitan's choice).
        self._autocast = (contextlib.nullcontext() if config.dtype == "float32" else
                          titan_dist.maybe_enable_amp(self.parallel_dims, config.dtype, self.device.type))

    def _set_optimizer_config(self, job: JobConfig) -> None:
        c = self.config
        job.optimizer.name = "AdamW"
        job.optimizer.lr, job.optimizer.eps, job.optimizer.weight_decay = c.lr, c.eps, c.weight_decay
        job.optimizer.beta1, job.optimizer.beta2 = c.betas
        job.optimizer.implementation = "fused" if self.device.type == "cuda" else "foreach"
        job.lr_scheduler.warmup_steps = c.warmup_steps
        # decay_ratio=0: no decay phase (constant after warmup); None: decay from warmup to max_steps.
        job.lr_scheduler.decay_ratio = 0.0 if c.lr_decay == "constant" else None
        job.lr_scheduler.decay_type = "linear" if c.lr_decay == "constant" else c.lr_decay
        job.training.steps = c.max_steps

    @property
    def step(self) -> int:
        return self.train_state.step

    @property
    def policy_version(self) -> int:
        return self.train_state.policy_version

    # -- forward passes ---------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (differentiable when grad is on) and entropies (no grad) of input_ids[:, 1:]: [b, T-1]."""
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        # Sequence parallelism splits positions evenly across TP ranks; right padding changes no earlier logit.
        inputs = F.pad(inputs, (0, -inputs.shape[1] % self.parallel_dims.tp))
        with self._autocast:
            logits = self.model(inputs)[:, : targets.shape[1]]
        logprobs = token_logprobs(logits, targets, self.config.temperature)
        entropy = token_entropy(logits, self.config.temperature) if with_entropy else None
        return logprobs, entropy

    def _local_micro_batches(self, batch: TrainBatch) -> tuple[int, list[TrainBatch]]:
        start, stop = data_parallel_rows(batch.num_sequences, self.dp_degree, self.dp_rank)
        size = self.config.micro_batch_size
        micro = [batch.slice(s, min(s + size, stop)) for s in range(start, stop, size)]
        return start, micro

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log pi_theta(input_ids[:, 1:]) at the current weights: [B, T-1] float32 on CPU, for the whole batch."""
        check_input_ids(batch.input_ids, self.model_args)
        input_ids = batch.input_ids.to(self.device)
        start, stop = data_parallel_rows(input_ids.shape[0], self.dp_degree, self.dp_rank)
        size = self.config.micro_batch_size
        local = torch.cat([self._forward(input_ids[s:min(s + size, stop)], with_entropy=False)[0]
                           for s in range(start, stop, size)])
        return gather_rows(local, self.dp_degree, self.dp_group).cpu()

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`minibatches` optimizer steps, one per contiguous slice of the batch (every rank passes the same
        batch), as one policy version; returns the slices' metrics averaged. The LR schedule advances once."""
        if self.step >= self.config.max_steps:
            raise RuntimeError(f"train_step: step {self.step} reached TrainerConfig.max_steps={self.config.max_steps}")
        started = time.perf_counter()
        check_input_ids(batch.input_ids, self.model_args)
        count, rows = self.config.minibatches, batch.num_sequences
        if rows % (count * self.dp_degree):
            raise ValueError(f"batch of {rows} sequences: must be a multiple of TrainerConfig.minibatches={count} "
                             f"x the data-parallel degree {self.dp_degree}")
        batch = _to_device(batch, self.device)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        size = rows // count
        # Advantages come with the episodes, so a slice needs no whole groups; after the first slice the
        # samples are off-policy and the loss's clip bounds the update.
        per_slice = [self._optimizer_step(batch.slice(s, s + size)) for s in range(0, rows, size)]
        self.lr_schedulers.step()
        self.train_state.step += 1
        self.train_state.policy_version += 1
        metrics = {key: sum(m[key] for m in per_slice) / count for key in per_slice[0]}
        metrics.update(lr=lr, tokens_per_second=batch.input_ids.numel() / (time.perf_counter() - started),
                       policy_version=float(self.policy_version))
        interval = self.config.checkpoint_interval
        if interval and self.step % interval == 0:
            self.save_checkpoint()
        return metrics

    def accumulate_gradients(
        self, batch: TrainBatch, loss_fn: Any, loss_params: dict[str, Any], *, with_entropy: bool = False
    ) -> tuple[LossOutput, torch.Tensor, torch.Tensor | None]:
        """Add d(loss)/d(params) of the whole batch to the parameters' gradients, micro-batch by micro-batch.

        Returns the loss output, the batch's log-probs [B, T-1] (detached) and, if asked, the token entropies.
        """
        start, micro = self._local_micro_batches(batch)
        # Log-probs of this rank's rows; with one micro-batch keep its graph for the backward pass.
        keep_graph = len(micro) == 1
        with torch.set_grad_enabled(keep_graph):
            parts = [self._forward(mb.input_ids, with_entropy=with_entropy) for mb in micro]
        local_logprobs = torch.cat([lp for lp, _ in parts])
        entropy = gather_rows(torch.cat([e for _, e in parts]), self.dp_degree, self.dp_group) if with_entropy else None
        logprobs = gather_rows(local_logprobs.detach(), self.dp_degree, self.dp_group).requires_grad_()

        out: LossOutput = loss_fn(logprobs, batch, **loss_params)
        if not out.loss.requires_grad:
            name = getattr(loss_fn, "__name__", repr(loss_fn))
            raise ValueError(f"loss {name!r} returned a loss that does not depend on the log-probs")
        (loss_grad,) = torch.autograd.grad(out.loss, logprobs)
        # FSDP averages gradients over data-parallel ranks, but each rank's share is already exact: undo it.
        local_grad = loss_grad[start : start + local_logprobs.shape[0]] * self.dp_degree
        if keep_graph:
            local_logprobs.backward(local_grad)
        else:
            offset = 0
            for mb in micro:
                mb_logprobs, _ = self._forward(mb.input_ids, with_entropy=False)
                mb_logprobs.backward(local_grad[offset : offset + mb.num_sequences])
                offset += mb.num_sequences
        return out, logprobs.detach(), entropy

    def _optimizer_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the whole (mini)batch; each rank back-propagates its own rows."""
        self.optimizers.zero_grad()
        out, _, entropy = self.accumulate_gradients(batch, self.loss_fn, self.config.loss_params, with_entropy=True)
        grad_norm = titan_dist.clip_grad_norm_(list(self.model.parameters()), self.config.max_grad_norm, foreach=True)
        self.optimizers.step()
        mask = batch.response_mask
        return {
            **out.metrics,
            "loss": out.loss.item(),
            "grad_norm": grad_norm.item(),
            "entropy": ((entropy * mask).sum() / mask.sum().clamp(min=1)).item(),
        }

    # -- weights in Hugging Face names --------------------------------------------------------------

    def _titan_state_dict(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.model)
        if getattr(self.model_args, "enable_weight_tying", False):
            state.pop("output.weight")  # shares the embedding's storage; HF checkpoints leave lm_head out too
        return state

    def hf_state_dict_shards(self) -> dict[str, torch.Tensor]:
        """The live parameters in HF names without a copy: DTensors (this rank's shard and its placement)
        under FSDP/TP, plain tensors on one rank. Cheap for qwen3, whose names map one to one; llama3's
        adapter permutes q and k, which redistributes those DTensors."""
        return self.adapter.to_hf(self._titan_state_dict())

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A snapshot of the full (unsharded) weights in HF names, cast to `dtype` (shard by shard, before
        gathering) when given. Under FSDP/TP this gathers: call it on every rank."""
        full = {}
        for name, tensor in self._titan_state_dict().items():
            tensor = tensor.detach().to(dtype or tensor.dtype)
            full[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()
        return self.adapter.to_hf(full)

    def export_hf(self, path: str | os.PathLike) -> str:
        """Write a HF checkpoint folder that transformers loads: config.json and tokenizer files from the
        source checkpoint, model.safetensors in the source's dtype. Call on every rank; rank 0 writes."""
        dtype = TORCH_DTYPE_MAP.get(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype"), torch.float32)
        state = self.hf_state_dict(dtype)
        path = Path(path)
        if self.rank == 0:
            staging = _fresh_staging_dir(path)
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, staging / "model.safetensors",
                      metadata={"format": "pt"})
            for source in self.model_path.iterdir():
                if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(source, staging / source.name)
            _move_into_place(staging, path)
        self._barrier()
        return str(path)

    # -- checkpoints ------------------------------------------------------------------------------

    def _checkpoint_states(self) -> dict[str, Any]:
        # torchtitan's CheckpointManager layout: model keys at the top level, then the stateful parts.
        # Fresh each time: FSDP re-allocates unevenly sharded parameters at its first forward pass, so a
        # state dict taken earlier (torchtitan's ModelWrapper caches one) can hold stale shards.
        return {**get_model_state_dict(self.model), "optimizer": self.optimizers,
                "lr_scheduler": self.lr_schedulers, "train_state": self.train_state}

    def save_checkpoint(self, path: str | os.PathLike | None = None) -> str:
        """Save model, optimizer, LR schedule, step and policy version with DCP (each rank writes its
        shards) to `path`, default `<checkpoint_dir>/step-<step>`, plus the size and CRC32 of every file.
        Written into `<path>.partial` and renamed, so `path` is either absent or complete. Call on every rank."""
        if path is None:
            if self.config.checkpoint_dir is None:
                raise ValueError("save_checkpoint: no path given and TrainerConfig.checkpoint_dir is None")
            path = Path(self.config.checkpoint_dir) / f"step-{self.step}"
        path = Path(path)
        staging = path.with_name(path.name + ".partial")
        if self.rank == 0:
            _fresh_staging_dir(path)
        self._barrier()
        # dcp.save returns on every rank only after rank 0 has written .metadata, the last file.
        dcp.save(self._checkpoint_states(), checkpoint_id=str(staging), no_dist=self.world_size == 1)
        checksums = self._file_checksums(staging, sorted(f.name for f in staging.iterdir()))
        if self.rank == 0:
            (staging / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1))
            _move_into_place(staging, path)
        self._barrier()
        return str(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore everything `save_checkpoint` saved; the next step is the one the saved run took next.
        Raises FileNotFoundError for an incomplete folder and RuntimeError for a corrupt one."""
        path = Path(path)
        if not (path / CHECKSUMS_FILE).is_file():
            raise FileNotFoundError(f"load_checkpoint: {path} is not a complete checkpoint: no {CHECKSUMS_FILE} "
                                    "(save_checkpoint writes it last)")
        expected = json.loads((path / CHECKSUMS_FILE).read_text())
        missing = sorted(name for name in expected if not (path / name).is_file())
        if missing:
            raise FileNotFoundError(f"load_checkpoint: {path} is missing {missing}")
        corrupt = sorted(n for n, found in self._file_checksums(path, sorted(expected)).items() if found != expected[n])
        if corrupt:
            raise RuntimeError(f"load_checkpoint: {path} is corrupt: {corrupt} differ from the size and CRC32 "
                               f"recorded in {CHECKSUMS_FILE} when it was saved")
        states = self._checkpoint_states()
        try:
            dcp.load(states, checkpoint_id=str(path), no_dist=self.world_size == 1)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
            causes = [exc for exc, _ in e.failures.values()] if isinstance(e, dcp.CheckpointException) else [e]
            reasons = "; ".join(f"{type(c).__name__}: {c}" for c in causes)
            raise RuntimeError(f"load_checkpoint: {path} does not match this model and optimizer ({reasons})") from e
        model_state = {k: v for k, v in states.items() if k not in ("optimizer", "lr_scheduler", "train_state")}
        set_model_state_dict(self.model, model_state)

    def _file_checksums(self, folder: Path, names: list[str]) -> dict[str, list[int]]:
        """[size, CRC32] of each named file; the ranks share the reading."""
        mine = {name: [(folder / name).stat().st_size, _crc32(folder / name)]
                for name in names[self.rank :: self.world_size]}
        if self.world_size == 1:
            return mine
        shares: list[dict[str, list[int]]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(shares, mine)
        return {name: value for share in shares for name, value in share.items()}

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return TrainBatch(**{k: None if v is None else v.to(device) for k, v in values.items()})


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fresh_staging_dir(path: Path) -> Path:
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
    staging.mkdir(parents=True)
    return staging


def _move_into_place(staging: Path, path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    os.rename(staging, path)


class TrainerActor(ForgeActor):
    """The trainer on a proc mesh of `procs` data-parallel ranks: every endpoint runs on every rank.

    After each optimizer step the new weights (HF names) are published to the weight store as the next
    policy version; versions older than `keep_versions` are deleted, so the store stays flat.
    """

    def __init__(self, config: TrainerConfig | dict, weight_namespace: str = "policy", keep_versions: int = 3) -> None:
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig(**config)
        self.weight_namespace = weight_namespace
        self.keep_versions = keep_versions

    @endpoint
    async def setup(self) -> None:
        if self.config.torch_threads and self.config.device == "cpu":
            # On a shared CPU host, more threads than cores left idle only adds contention.
            torch.set_num_threads(self.config.torch_threads)
        rank, world_size = init_from_environment(self.config.device)
        self.trainer = TitanTrainer(self.config, rank=rank, world_size=world_size)
        self.store = WeightStore(self.weight_namespace)

    @endpoint
    async def publish_weights(self) -> int:
        """Publish the current weights as the current policy version (e.g. version 0 before any rollout)."""
        return await self._publish()

    async def _publish(self) -> int:
        version = self.trainer.policy_version
        await self.store.publish(self.trainer.hf_state_dict(), version)
        if self.trainer.rank == 0:
            await self.store.delete_older_than(version - self.keep_versions + 1)
        return version

    @endpoint
    async def train_step(self, episodes: list[Episode], pad_id: int) -> dict[str, float]:
        """One training step on the whole batch (each rank trains its slice; `minibatches` optimizer steps),
        then publish the new weights as the next policy version."""
        batch = TrainBatch.from_episodes(episodes, pad_id)
        metrics = self.trainer.train_step(batch)
        start = time.perf_counter()
        metrics["policy_version"] = float(await self._publish())
        metrics["publish_s"] = time.perf_counter() - start
        return metrics

    @endpoint
    async def policy_version(self) -> int:
        return self.trainer.policy_version

    @endpoint
    async def save_checkpoint(self, path: str) -> str:
        return self.trainer.save_checkpoint(path)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        self.trainer.load_checkpoint(path)
        return self.trainer.policy_version

    @endpoint
    async def export_hf(self, path: str) -> str:
        return self.trainer.export_hf(path)
