"""A torchtitan model built from a Hugging Face checkpoint: its configuration read from `config.json` (so one code
path loads a tiny test model and Qwen3-8B), parallelized (FSDP2, TP) over the ranks, and loaded from the
checkpoint's safetensors or from a torchtitan/DCP checkpoint; and attention within the documents of packed rows
(`DocumentMask`, taken by `SDPAttention`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Decoder, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols import BaseStateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module
from torchtitan.tools.utils import set_default_dtype

from actors import checkpoint as checkpoints
from actors import lora as lora_layers
from actors.lora_config import LoRAConfig
from actors.model_layout import check_hf_config, check_parallel_layout, rope_settings


class DocumentMask:
    """Causal attention within each document of packed rows: query t sees key s iff s <= t and both are tokens of the
    same document. `allowed` is that as the dense [B, 1, T, T] boolean mask SDPA takes; the model's forward hands it
    (its `attention_masks`) to every layer's inner attention, activation checkpointing's recomputation included."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> DocumentMask:
        """The mask of rows whose token t belongs to document `document_ids[b, t]` ([B, T], a document's tokens
        contiguous)."""
        length = document_ids.shape[1]
        positions = torch.arange(length, device=document_ids.device)
        same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
        return cls((same & (positions.unsqueeze(1) >= positions.unsqueeze(0))).unsqueeze(1))


class SDPAttention(Module):
    """The inner attention of every layer forge builds: SDPA on torchtitan's (B, L, N, H) layout, causal, or within the
    documents of a `DocumentMask` (the fused kernels on CUDA, the CPU kernel on CPU).

    forge.compat 40: torchtitan 0.3.0 refuses "sdpa" as a language model's attention backend (flex, flex_flash and
    varlen remain), and FlexAttention has no backward pass on CPU, so forge puts this module in each layer's
    configuration instead of the backend torchtitan would pick."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: Any = None,
                scale: float | None = None, enable_gqa: bool = False, **_: Any) -> torch.Tensor:
        if attention_masks is not None and not isinstance(attention_masks, DocumentMask):
            raise TypeError(f"attention_masks: {type(attention_masks).__name__}; SDPAttention takes None (causal) or "
                            "a DocumentMask")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, L, H), what SDPA takes
        mask = None if attention_masks is None else attention_masks.allowed
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2)


FAMILIES = {  # the torchtitan model, block, parallelize function and HF state-dict adapter of each family
    "qwen3": (Qwen3Model, Qwen3TransformerBlock, parallelize_qwen3, Qwen3StateDictAdapter),
    "llama3": (Llama3Model, Llama3TransformerBlock, parallelize_llama, Llama3StateDictAdapter),
}


def model_config_from_hf(family: str, hf_config: dict[str, Any]) -> Decoder.Config:
    """torchtitan's model configuration equivalent to a Hugging Face `config.json` of that family.

    Built from torchtitan's own pieces (make_gqa_config, make_ffn_config), as its presets are, with q, k and v as
    separate projections (`fuse_qkv=False`: the presets fuse them): LoRA adapts each projection on its own, and the
    parameters keep one Hugging Face tensor each, so publishing needs no copy. No parameter initializers: every weight
    is loaded (a module without one falls back to its `reset_parameters`)."""
    check_hf_config(family, hf_config)
    model_cls, block_cls, _, _ = FAMILIES[family]
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    n_kv_heads = hf_config.get("num_key_value_heads") or n_heads
    vocab, eps = hf_config["vocab_size"], hf_config["rms_norm_eps"]
    theta, scaling = rope_settings(hf_config)
    max_seq_len = hf_config["max_position_embeddings"]
    if family == "qwen3":
        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=theta)
        qk_norm = RMSNorm.Config(normalized_shape=head_dim, eps=eps)
    else:  # rope_type "llama3" or none (check_hf_config refuses the others)
        llama = {} if scaling is None else dict(
            scaling="llama", scaling_factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"])
        rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=theta, **llama)
        qk_norm = None
    layers = [block_cls.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                  wqkv_param_init=None, wo_param_init=None, inner_attention=SDPAttention.Config(),
                                  fuse_qkv=False, rope=rope, qk_norm=qk_norm),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=hf_config["intermediate_size"], w1_param_init=None,
                                     w2w3_param_init=None),
    ) for _ in range(hf_config["num_hidden_layers"])]
    return model_cls.Config(
        dim=dim, vocab_size=vocab, norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab), layers=layers,
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)))


def model_spec(family: str, hf_config: dict[str, Any]) -> ModelSpec:
    """torchtitan's bundle for the checkpoint's model: its configuration, parallelize function and HF adapter."""
    _, _, parallelize, adapter = FAMILIES[family]
    return ModelSpec(name=family, flavor="hf", model=model_config_from_hf(family, hf_config),
                     parallelize_fn=parallelize, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=adapter)


def state_dict_adapter(spec: ModelSpec) -> BaseStateDictAdapter:
    return spec.state_dict_adapter(spec.model, None)


def resolve_model_path(model_path: str) -> Path:
    """A local checkpoint folder as is; a hub id downloaded (config, tokenizer, safetensors only)."""
    if Path(model_path).exists():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    return Path(snapshot_download(model_path, allow_patterns=patterns))


def parallel_dims(world_size: int, tensor_parallel_degree: int = 1) -> ParallelDims:
    """FSDP over every rank (times TP when asked): the only layout forge trains and scores with. The DTensor
    ("partial_dtensor") backend: what torchtitan 0.2.0 ran, and what forge's gathers and tests read."""
    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tensor_parallel_degree, pp=1, ep=1,
                        world_size=world_size, spmd_backend="partial_dtensor")


@dataclass
class ModelSettings:
    """What torchtitan's parallelize functions read beside the model: the compute dtype, the TP degree and the
    activation checkpointing (none, selective, full)."""

    dtype: str = "float32"
    tensor_parallel_degree: int = 1
    activation_checkpoint: str = "none"

    def parallelism(self) -> ParallelismConfig:
        return ParallelismConfig(tensor_parallel_degree=self.tensor_parallel_degree, spmd_backend="partial_dtensor")


def activation_checkpointing(mode: str) -> FullAC.Config | SelectiveAC.Config | None:
    """torchtitan's activation checkpointing for `mode` (None for "none"). Without preserving the random state, as
    torchtitan 0.2.0 did: TrainerConfig refuses LoRA dropout with it (actors/trainer_config.py)."""
    if mode == "none":
        return None
    return (FullAC if mode == "full" else SelectiveAC).Config(preserve_rng_state=False)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block of `model` in torchtitan's activation checkpointing `mode` (none: nothing)."""
    config = activation_checkpointing(mode)
    if config is not None:
        config.build(dump_folder="").apply(model)


def sum_gradients_over_gloo(model: nn.Module) -> None:
    """forge.compat 41: torchtitan 0.3.0 sets FSDP's gradient divide factor to 1 (gradients are summed over the
    data-parallel ranks), which FSDP reduces with ReduceOp.PREMUL_SUM(1.0), an op gloo does not have ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). A plain SUM is the same reduction: FSDP uses it when forced to."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


@dataclass
class _Parallelism:  # what a model configuration's update_from_config reads
    parallelism: ParallelismConfig


def build_model(
    model_path: Path,
    family: str,
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    parallel_dims: ParallelDims,
    settings: ModelSettings,
    init_checkpoint: str | None = None,
    lora: LoRAConfig | None = None,
    lora_seed: int = 0,
) -> tuple[nn.Module, Decoder.Config, BaseStateDictAdapter]:
    """The family's torchtitan model for a checkpoint: built on meta, parallelized (FSDP2, TP) when there is
    more than one rank, activation-checkpointed as `settings` say (on one rank too), materialized on `device`, and
    loaded from the HF safetensors (or `init_checkpoint`, including one written under torchtitan 0.2.0's names).
    With `lora`, peft's LoRA layers wrap the targeted linear layers first (so FSDP shards the adapters with
    their blocks); the base is loaded as above and frozen, the adapters start at peft's initialization."""
    hf_config = json.loads((model_path / "config.json").read_text())
    spec = model_spec(family, hf_config)
    model_config = spec.model
    adapter = state_dict_adapter(spec)
    check_parallel_layout(hf_config, parallel_dims.world_size, parallel_dims.tp)
    if parallel_dims.world_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"world_size={parallel_dims.world_size}: initialize torch.distributed first")
    if parallel_dims.world_size > 1:
        model_config.update_from_config(config=_Parallelism(settings.parallelism()))  # TP's sharding plans
    with torch.device("meta"), set_default_dtype(param_dtype):
        model = model_config.build()
        if lora is not None:
            lora_layers.inject(model, lora, lora_layers.titan_targets(lora, adapter))
    if parallel_dims.world_size > 1:
        # parallelize_fn asserts seq_len is a multiple of 2 * TP; it bounds nothing at run time.
        seq_len = model_config.max_seq_len - model_config.max_seq_len % (2 * parallel_dims.tp)
        # torchtitan picks its device type at import and falls back to "cuda" on a host without GPUs;
        # the mesh it builds for the parallelisms must be on this trainer's device type.
        titan_parallel_dims.device_type = device.type
        model = spec.parallelize_fn(
            model, parallel_dims=parallel_dims,
            training=TrainingConfig(seq_len=seq_len, mixed_precision_param=settings.dtype),
            parallelism=settings.parallelism(), compile_config=CompileConfig(),
            ac_config=activation_checkpointing(settings.activation_checkpoint), dump_folder="")
        if dist.get_backend() == "gloo":
            sum_gradients_over_gloo(model)
    model.to_empty(device=device)
    with torch.no_grad():
        # Materializes the buffers (RoPE) and re-ties a tied lm_head (to_empty unties it); the weights are loaded next.
        model.init_states(buffer_device=None)
    # The base weights under the names of the model without adapters (what checkpoints and the adapter use).
    live = get_model_state_dict(model)
    model_names = {lora_layers.base_key(k): k for k in live if not lora_layers.is_adapter_key(k)}
    model_state = {base: live[name] for base, name in model_names.items()}
    # One rank reads alone even when the process has a process group (for other work) of several ranks.
    no_dist = parallel_dims.world_size == 1
    if init_checkpoint is not None:  # torchtitan's layout: the model's keys at the top level
        names = checkpoints.names_in(Path(init_checkpoint))
        dcp.load({names(k): v for k, v in model_state.items()}, checkpoint_id=init_checkpoint, no_dist=no_dist)
    else:
        # A tied checkpoint has no lm_head.weight: the adapter leaves it out, and from_hf ties it to the embedding.
        hf_state = adapter.to_hf(model_state)
        dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(model_path)), no_dist=no_dist)
        model_state = adapter.from_hf(hf_state)
    # dcp.load wrote into the parameters unless the adapter made copies (llama3 permutes q and k): copy back.
    set_model_state_dict(model, {model_names[k]: v for k, v in model_state.items()},
                         options=StateDictOptions(strict=False))
    if lora is not None:
        lora_layers.init_adapters(model, lora_seed)
    if parallel_dims.world_size == 1:
        # torchtitan applies it in parallelize_fn, which needs a process group; on one rank it is applied here, last:
        # a checkpoint wrapper renames the parameters it wraps, which loading and init_adapters match by name.
        apply_activation_checkpointing(model, settings.activation_checkpoint)
    return model, model_config, adapter
