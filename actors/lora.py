"""LoRA on the trainer's torchtitan model, with peft's layers, and the adapter in Hugging Face / peft names.

    targets = titan_targets(lora, state_dict_adapter)     # ["attention.qkv_linear.wq", "lm_head", ...]: via the adapter's names
    inject(model, lora, targets)                          # on the meta model, before FSDP: peft's LoRA layers
    ...                                                   # load the base, then init_adapters(model, seed)
    adapter_hf = to_peft_names(adapter_state(get_model_state_dict(model)), state_dict_adapter)  # "model.layers.0...q_proj.lora_A.weight"

peft wraps each targeted linear layer in place: its weight moves to `<module>.base_layer.weight` and the
adapter is `<module>.lora_A.default.weight` [rank, in] and `<module>.lora_B.default.weight` [out, rank];
only those require grad. The Hugging Face <-> torchtitan name mapping is torchtitan's state-dict adapter
(the one the full-weight export uses), applied to the adapted module's base weight name.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torchtitan.protocols import BaseStateDictAdapter

from actors.engines.lora_weights import write_peft_adapter
from actors.lora_config import LoRAConfig

ADAPTER_NAME = "default"  # peft's name for a model's only adapter


def adapter_key(adapter_name: str = ADAPTER_NAME) -> re.Pattern:
    """Matches `<module>.lora_A.<adapter_name>.weight` (and the saved form without the adapter's name)."""
    return re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?:" + re.escape(adapter_name) + r"\.)?weight$")


_LORA_KEY = adapter_key()
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # torch's activation-checkpoint wrapper's submodule name


def titan_targets(lora: LoRAConfig, adapter: BaseStateDictAdapter) -> list[str]:
    """The torchtitan module suffixes (e.g. "attention.qkv_linear.wq") of the HF modules `lora.target_modules` names.
    One per projection: forge builds q, k and v unfused (actors/model_builder.py)."""
    targets = []
    for name in lora.target_modules:
        # At most one "{}" (the layer): a dense layer's module or lm_head, not a mixture-of-experts' per-expert one.
        matches = {titan for hf, titan in adapter.from_hf_map.items()
                   if titan is not None and f".{hf}".endswith(f".{name}.weight") and hf.count("{}") <= 1}
        if len(matches) != 1:
            raise ValueError(f"LoRA target {name!r}: torchtitan's state-dict adapter maps it to {sorted(matches)}; "
                             "expected exactly one module")
        targets.append(matches.pop().removeprefix("layers.{}.").removesuffix(".weight"))
    return targets


def inject(model: nn.Module, lora: LoRAConfig, targets: list[str], *, adapter_name: str = ADAPTER_NAME) -> None:
    """Wrap the targeted linear layers in peft's LoRA layers (or add the adapter `adapter_name` to layers that
    already have one); freeze everything but this adapter."""
    # Imported here: peft (and the transformers modules it loads) would add seconds to every trainer's start.
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    with warnings.catch_warnings():  # a second named adapter on one model is what the caller asked for
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(config, model, adapter_name=adapter_name)
    key = adapter_key(adapter_name)
    for name, param in model.named_parameters():
        param.requires_grad_(key.match(name) is not None)


def base_key(name: str) -> str:
    """A model state-dict key as the model without adapters names it (peft moves weights under base_layer)."""
    return name.replace(".base_layer.", ".")


def is_adapter_key(name: str) -> bool:
    return _LORA_KEY.match(name) is not None


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, *, adapter_name: str = ADAPTER_NAME) -> None:
    """peft's default initialization (A: nn.Linear's Kaiming-uniform, B: zero, so training starts at the base
    model), drawn as full tensors from one seeded generator: every rank and every world size gets the same
    adapters, then each keeps its shard."""
    gen = torch.Generator().manual_seed(seed)
    full = {}
    key = adapter_key(adapter_name)
    for name, param in model.named_parameters():
        match = key.match(name)
        if match is None:
            continue
        value = torch.zeros(param.shape, dtype=param.dtype)
        if match["part"] == "lora_A":
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
        # The state dict's names are the model's without activation checkpointing's wrapper (applied before FSDP on
        # several ranks): a wrapped name would match nothing and, with strict=False, leave the adapters at zero.
        full[name.replace(CHECKPOINT_WRAPPER_PREFIX, "")] = value
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def adapter_state(state: dict[str, torch.Tensor], *, adapter_name: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """The entries of adapter `adapter_name` in a model state dict (torchtitan names)."""
    key = adapter_key(adapter_name)
    return {name: tensor for name, tensor in state.items() if key.match(name) is not None}


def to_peft_names(adapter: dict[str, torch.Tensor], state_dict_adapter: BaseStateDictAdapter,
                  *, scaling: float = 1.0) -> dict[str, torch.Tensor]:
    """torchtitan adapter entries -> `<hf module>.lora_A.weight` / `.lora_B.weight` (peft's saved names, without
    PEFT_PREFIX). `scaling` multiplies B (a new tensor): published adapters carry alpha / rank inside B."""
    out = {}
    for name, tensor in adapter.items():
        match = _LORA_KEY.match(name)
        (hf_weight,) = state_dict_adapter.to_hf({f"{match['module']}.weight": tensor}).keys()
        value = tensor * scaling if match["part"] == "lora_B" and scaling != 1.0 else tensor
        out[f"{hf_weight.removesuffix('.weight')}.{match['part']}.weight"] = value
    return out


def export_peft(adapter_hf: dict[str, torch.Tensor], lora: LoRAConfig, base_model: str, path: Path) -> None:
    """Write `path` as peft writes an adapter: adapter_config.json and adapter_model.safetensors."""
    write_peft_adapter(adapter_hf, path, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, base_model=base_model)
