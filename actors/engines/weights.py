"""What an engine's weights must look like: the HF parameter specs of a model and the check of a state dict
against them (both engines refuse a mismatching update with the same message)."""

from __future__ import annotations

import torch

_SHOWN_MISMATCHES = 5


def hf_weight_specs(model: torch.nn.Module) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
    """A transformers model's state-dict names -> (shape, dtype), and the names a state dict must hold:
    tied weights appear under two names, and either one loads them."""
    specs = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return specs, set(specs) - aliases


def check_state_dict(state_dict: dict[str, torch.Tensor], version: int,
                     specs: dict[str, tuple[tuple[int, ...], torch.dtype]], required: set[str], caller: str, *,
                     current_version: int) -> None:
    """Raise ValueError naming every missing, unexpected, misshapen or non-float tensor (HF names); a floating
    tensor of another dtype is fine (it is cast on load)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"{caller}: version={version!r}: must be an int >= 0")
    missing = sorted(required - state_dict.keys())
    unexpected = sorted(state_dict.keys() - specs.keys())
    mismatched = []
    for name, tensor in sorted(state_dict.items()):
        if name not in specs:
            continue
        shape, dtype = specs[name]
        if not isinstance(tensor, torch.Tensor):
            mismatched.append(f"{name}: got {type(tensor).__name__}, expected a tensor")
        elif tuple(tensor.shape) != shape:
            mismatched.append(f"{name}: got shape {tuple(tensor.shape)}, expected {shape}")
        elif not tensor.dtype.is_floating_point:
            mismatched.append(f"{name}: got dtype {tensor.dtype}, expected a floating dtype ({dtype})")
    problems = [
        f"{len(items)} {label} {items[:_SHOWN_MISMATCHES]}{' ...' if len(items) > _SHOWN_MISMATCHES else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched))
        if items
    ]
    if problems:
        raise ValueError(f"{caller}(version={version}): the state dict does not match the model: "
                         f"{'; '.join(problems)}. Weights stay at version {current_version}.")
