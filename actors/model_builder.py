"""A torchtitan model built from a Hugging Face checkpoint: arguments read from its `config.json` (so one code
path loads a tiny test model and Qwen3-8B), parallelized (FSDP2, TP) over the ranks, and loaded from the
checkpoint's safetensors or from a torchtitan/DCP checkpoint; and attention within the documents of packed rows
(`DocumentMask`, `document_attention`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.nn.attention.flex_attention import BlockMask
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols import BaseModelArgs, BaseStateDictAdapter
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import set_default_dtype

from actors import lora as lora_layers
from actors.lora_config import LoRAConfig
from actors.model_config import is_int
from actors.model_layout import check_hf_config, check_parallel_layout, rope_settings


def model_args_from_hf(family: str, hf_config: dict[str, Any]) -> BaseModelArgs:
    """torchtitan model arguments equivalent to a Hugging Face `config.json` of that family."""
    check_hf_config(family, hf_config)
    rope_theta, rope_scaling = rope_settings(hf_config)
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    common = dict(
        dim=dim,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        vocab_size=hf_config["vocab_size"],
        norm_eps=hf_config["rms_norm_eps"],
        rope_theta=rope_theta,
        max_seq_len=hf_config["max_position_embeddings"],
    )
    eos_id = hf_config.get("eos_token_id")
    if is_int(eos_id):
        common["eos_id"] = eos_id
    tied = bool(hf_config.get("tie_word_embeddings", False))
    if family == "qwen3":
        return Qwen3ModelArgs(**common, head_dim=head_dim, hidden_dim=hf_config["intermediate_size"],
                              qk_norm=True, enable_weight_tying=tied)
    # torchtitan sizes the SwiGLU layer as multiple_of * ceil(int(multiplier * int(8 dim / 3)) / multiple_of);
    # multiple_of = intermediate_size makes that exactly intermediate_size whatever the float rounding.
    intermediate = hf_config["intermediate_size"]
    ffn = dict(multiple_of=intermediate, ffn_dim_multiplier=intermediate / int(8 * dim / 3))
    if rope_scaling is None:
        rope = RoPEScalingArgs(scaling_factor=1.0)  # torchtitan always applies Llama 3.1 scaling; 1 = none
    else:  # rope_type "llama3" (check_hf_config refuses the others)
        rope = RoPEScalingArgs(
            scaling_factor=rope_scaling["factor"],
            low_freq_factor=rope_scaling["low_freq_factor"],
            high_freq_factor=rope_scaling["high_freq_factor"],
            original_max_position_embeddings=rope_scaling["original_max_position_embeddings"],
        )
    return TransformerModelArgs(**common, **ffn, rope_scaling_args=rope)


def resolve_model_path(model_path: str) -> Path:
    """A local checkpoint folder as is; a hub id downloaded (config, tokenizer, safetensors only)."""
    if Path(model_path).exists():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    return Path(snapshot_download(model_path, allow_patterns=patterns))


def parallel_dims(world_size: int, tensor_parallel_degree: int = 1) -> ParallelDims:
    """FSDP over every rank (times TP when asked): the only layout forge trains and scores with."""
    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tensor_parallel_degree, pp=1, ep=1, etp=1,
                        world_size=world_size)


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
    lora: LoRAConfig | None = None,
    lora_seed: int = 0,
) -> tuple[nn.Module, BaseModelArgs, BaseStateDictAdapter]:
    """The family's torchtitan model for a checkpoint: built on meta, parallelized (FSDP2, TP) when there is
    more than one rank, activation-checkpointed as `job_config` says (on one rank too), materialized on `device`, and loaded from the HF safetensors (or `init_checkpoint`).
    With `lora`, peft's LoRA layers wrap the targeted linear layers first (so FSDP shards the adapters with
    their blocks); the base is loaded as above and frozen, the adapters start at peft's initialization."""
    hf_config = json.loads((model_path / "config.json").read_text())
    model_args = model_args_from_hf(family, hf_config)
    spec = get_train_spec(family)
    adapter = spec.state_dict_adapter(model_args, None)
    with torch.device("meta"), set_default_dtype(param_dtype):
        model = spec.model_cls(model_args)
        if lora is not None:
            lora_layers.inject(model, lora, lora_layers.titan_targets(lora, adapter))
    tied = getattr(model_args, "enable_weight_tying", False)
    check_parallel_layout(hf_config, parallel_dims.world_size, parallel_dims.tp)
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
    # The base weights under the names of the model without adapters (what checkpoints and the adapter use).
    live = get_model_state_dict(model)
    model_names = {lora_layers.base_key(k): k for k in live if not lora_layers.is_adapter_key(k)}
    model_state = {base: live[name] for base, name in model_names.items()}
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
    set_model_state_dict(model, {model_names[k]: v for k, v in model_state.items()},
                         options=StateDictOptions(strict=False))
    if lora is not None:
        lora_layers.init_adapters(model, lora_seed)
    if parallel_dims.world_size == 1 and job_config.activation_checkpoint.mode != "none":
        # torchtitan applies it in parallelize_fn, which needs a process group; on one rank it is applied here, last:
        # a checkpoint wrapper renames the parameters it wraps, which loading and init_adapters match by name.
        apply_ac(model, job_config.activation_checkpoint)
    return model, model_args, adapter


class DocumentMask(BlockMask):
    """Causal attention within each document of packed rows: query t sees key s iff s <= t and both are tokens of the
    same document. `allowed` is that as the dense [B, 1, T, T] boolean mask SDPA takes.

    A BlockMask because torchtitan's attention layers hand their `attention_masks` argument to the inner attention
    only on their flex branch, which takes BlockMasks; as an argument of the forward it reaches every layer and
    activation checkpointing's recomputation too. Its block structure is one block per row, exact with `mask_mod`,
    so flex_attention could take it as well."""

    allowed: torch.Tensor

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> DocumentMask:
        """The mask of rows whose token t belongs to document `document_ids[b, t]` ([B, T], a document's tokens
        contiguous)."""
        rows, length = document_ids.shape
        positions = torch.arange(length, device=document_ids.device)
        same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
        allowed = (same & (positions.unsqueeze(1) >= positions.unsqueeze(0))).unsqueeze(1)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return allowed[b, 0, q, kv]

        one_block = dict(device=document_ids.device, dtype=torch.int32)
        mask = cls.from_kv_blocks(torch.ones(rows, 1, 1, **one_block), torch.zeros(rows, 1, 1, 1, **one_block),
                                  BLOCK_SIZE=(length, length), mask_mod=mask_mod, seq_lengths=(length, length))
        mask.allowed = allowed
        return mask


class DocumentAttention(nn.Module):
    """The inner attention of a layer under `document_attention`: SDPA with the DocumentMask's dense mask (the fused
    kernels on CUDA, the CPU kernel on CPU; eager flex_attention on CPU is an unfused reference, many times slower)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: DocumentMask,
                scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask.allowed, scale=scale)


@contextlib.contextmanager
def document_attention(model: nn.Module) -> Iterator[None]:
    """For the block, every attention layer of `model` (torchtitan's llama3 and qwen3) attends as the forward's
    `attention_masks` (a DocumentMask) says, then causally again. Hold it over the backward pass too: activation
    checkpointing recomputes the forward there."""
    layers = [m for m in model.modules() if hasattr(m, "use_flex_attn") and hasattr(m, "inner_attention")]
    saved = [(m.use_flex_attn, m.inner_attention) for m in layers]
    for layer in layers:
        layer.use_flex_attn, layer.inner_attention = True, DocumentAttention()
    try:
        yield
    finally:
        for layer, (flex, inner) in zip(layers, saved):
            layer.use_flex_attn, layer.inner_attention = flex, inner
