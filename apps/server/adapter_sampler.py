"""Sampling with saved LoRA adapters over the LoRA trainer's own base tensors.

The Hugging Face model here is built without weights and then given the trainer's frozen base tensors
(`load_state_dict(assign=True)`: the same storage, no copy), so the base is in memory once for training and
sampling. Each saved adapter (a peft folder from `save_weights_for_sampler`) is loaded once with peft as a named
adapter (`PeftModel.load_adapter`), kept for later requests (the oldest dropped beyond `max_adapters`), and made
the active one for its request; the adapter runs in the forward pass, so the base never changes. Generation is
forge's hf engine (`HFEngine.from_model`): the same sampling and log-prob rules as the generators.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from accelerate import init_empty_weights

from actors.engines.hf import HFEngine
from rl.types import Completion, SamplingParams


def shared_base_model(base_hf_state: dict[str, torch.Tensor], model_path: str) -> torch.nn.Module:
    """The HF causal LM of `model_path` whose parameters are the tensors of `base_hf_state` (no copy)."""
    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) real
        model = AutoModelForCausalLM.from_config(config, dtype=next(iter(base_hf_state.values())).dtype)
    missing, unexpected = model.load_state_dict(base_hf_state, assign=True, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"the trainer's base does not fit {model_path}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False)


class AdapterSampler:
    """Generation with any saved adapter of the served base model, one adapter active per request."""

    def __init__(self, base_hf_state: dict[str, torch.Tensor], model_path: str, *, seed: int = 0,
                 max_adapters: int = 8) -> None:
        self.model_path = str(Path(model_path).resolve())
        self.model = shared_base_model(base_hf_state, model_path)
        self.engine = HFEngine.from_model(self.model, AutoTokenizer.from_pretrained(model_path), seed=seed)
        self.max_adapters = max_adapters
        self.peft: PeftModel | None = None
        self.adapters: OrderedDict[tuple[str, int], str] = OrderedDict()  # (folder, file mtime) -> adapter name
        self._names = 0

    def _adapter(self, path: str) -> str:
        """The peft name of the adapter saved at `path`, loading it on first use."""
        weights = Path(path, "adapter_model.safetensors")
        key = (str(Path(path).resolve()), weights.stat().st_mtime_ns)  # a name saved again is a new adapter
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return self.adapters[key]
        base = json.loads(Path(path, "adapter_config.json").read_text()).get("base_model_name_or_path")
        if base is not None and str(Path(base).resolve()) != self.model_path:
            raise ValueError(f"adapter {path} was trained on {base!r}, not the served base model {self.model_path!r}")
        self._names += 1
        name = f"sampler_{self._names}"
        if self.peft is None:  # wraps self.model in place: its LoRA layers serve every later adapter too
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        else:
            self.peft.load_adapter(path, adapter_name=name)
        self.adapters[key] = name
        if len(self.adapters) > self.max_adapters:
            _, oldest = self.adapters.popitem(last=False)
            self.peft.delete_adapter(oldest)
        return name

    def generate(self, adapter_path: str, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        name = self._adapter(adapter_path)
        self.peft.set_adapter(name)
        return self.engine.generate(prompts, params)

    def prompt_logprobs(self, adapter_path: str, prompt: list[int]) -> list[float]:
        """Log-probs of prompt[1:], each given the tokens before it, with the adapter at `adapter_path`."""
        name = self._adapter(adapter_path)
        self.peft.set_adapter(name)
        return self.engine.score(prompt[:1], prompt[1:])[0] if len(prompt) > 1 else []
