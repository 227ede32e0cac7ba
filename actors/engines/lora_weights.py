"""Adapter-only policy versions: what a LoRA trainer publishes (`<hf module>.lora_A.weight` [rank, in] and
`<hf module>.lora_B.weight` [out, rank], B already multiplied by alpha / rank), checked against an engine's
weights, and merged onto a base the engine keeps: `W = W_base + B @ A`, always from the kept base, so any
number of versions leaves no rounding behind."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

PEFT_PREFIX = "base_model.model."  # what a PeftModel around a transformers model adds to its module names

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(state_dict: dict[str, torch.Tensor]) -> bool:
    """A state dict of adapter tensors only (a LoRA trainer's version)."""
    return bool(state_dict) and all(name.endswith((LORA_A, LORA_B)) for name in state_dict)


def adapter_pairs(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`<module>.weight` -> (A, B) for every adapted module."""
    modules = {name.removesuffix(LORA_A).removesuffix(LORA_B) for name in state_dict}
    return {f"{m}.weight": (state_dict[m + LORA_A], state_dict[m + LORA_B]) for m in sorted(modules)}


def check_adapter(state_dict: dict[str, torch.Tensor], version: int,
                  specs: dict[str, tuple[tuple[int, ...], torch.dtype]], caller: str, *, current_version: int) -> None:
    """Raise ValueError naming every adapted module that is not a 2-D weight of the model, lacks A or B, or whose
    A [rank, in] / B [out, rank] do not fit it."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"{caller}: version={version!r}: must be an int >= 0")
    problems = []
    modules = {name.removesuffix(LORA_A).removesuffix(LORA_B) for name in state_dict}
    for module in sorted(modules):
        weight = f"{module}.weight"
        a, b = state_dict.get(module + LORA_A), state_dict.get(module + LORA_B)
        if weight not in specs or len(specs[weight][0]) != 2:
            problems.append(f"{module}: not a linear layer of the model")
        elif a is None or b is None:
            problems.append(f"{module}: has {'lora_B' if a is None else 'lora_A'} without "
                            f"{'lora_A' if a is None else 'lora_B'}")
        elif not (a.dtype.is_floating_point and b.dtype.is_floating_point):
            problems.append(f"{module}: lora_A/lora_B must be floating, got {a.dtype}/{b.dtype}")
        elif a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != specs[weight][0] or a.shape[0] != b.shape[1]:
            problems.append(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make "
                            f"[out, rank] @ [rank, in] = {specs[weight][0]}")
    if problems:
        raise ValueError(f"{caller}(version={version}): the adapter does not match the model: {'; '.join(problems)}. "
                         f"Weights stay at version {current_version}.")


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`base + b @ a` as a new tensor in base's dtype and device (the product in float32)."""
    # One float32 temporary, added into in place (a copy even when base is float32: the kept base never changes).
    merged32 = base.to(torch.float32, copy=True)
    merged32.addmm_(b.to(base.device, torch.float32), a.to(base.device, torch.float32))
    return merged32.to(base.dtype)


def target_modules(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The adapted modules' short names ("q_proj", ...), as peft's target_modules lists them."""
    return sorted({name.removesuffix(LORA_A).removesuffix(LORA_B).rsplit(".", 1)[-1] for name in state_dict})


def write_peft_adapter(adapter: dict[str, torch.Tensor], path: Path, *, rank: int, alpha: float, dropout: float = 0.0,
                       base_model: str | None = None) -> Path:
    """Write `path` as peft writes an adapter (adapter_config.json, adapter_model.safetensors) from HF-named
    adapter tensors: `PeftModel.from_pretrained(base, path)` and vLLM's LoRARequest both read it."""
    from peft import LoraConfig  # here: the engines import this module, and only an adapter writer needs peft

    path.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules(adapter),
               base_model_name_or_path=base_model).save_pretrained(str(path))
    save_file({PEFT_PREFIX + k: v.contiguous().cpu() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return path

