"""The vLLM engine (GPU): the production generator, same interface and Completion type as the hf engine.

Weights are swapped between batches: `stage_weights` keeps the newest staged version and `generate`
loads it before its batch starts, so every token of one `generate` call carries one policy version.

Behaviour log-probs: vLLM reports the log-prob of each sampled token from the raw logits
(log_softmax(z), its default logprobs mode). That equals the trainer's log_softmax(z / T) only at T = 1,
so this engine refuses sampling temperatures other than 1.0 (and 0.0, greedy evaluation) rather than
return log-probs of the wrong distribution.

Status: written against vLLM 0.11's `LLM` API; it needs a CUDA host and is exercised by
tests/actors/engines/test_vllm.py (marked `gpu`), which could not run on the machines this project was
developed on.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import threading
from functools import cache
from pathlib import Path

import torch

from forge.types import Completion, SamplingParams


@cache
def engine_arg_names() -> frozenset[str]:
    """The field names of vLLM's `AsyncEngineArgs` (what `engine_args` may hold), without importing vLLM.

    Importing `vllm.engine.arg_utils` pulls in vLLM's whole stack (~15 s on a loaded 2-core host), too slow for
    a config check before anything spawns; the dataclass fields are read from its source text instead
    (tests/actors/engines/test_vllm_args.py checks they equal `dataclasses.fields`).
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("engine_arg_names: the vllm package is not installed; install it with "
                          "`pip install 'forge[vllm]'` (CUDA) or `make install-vllm` (CPU)")
    source = Path(spec.submodule_search_locations[0], "engine", "arg_utils.py").read_text()
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names.update(statement.target.id for statement in node.body
                         if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                         and "ClassVar" not in ast.unparse(statement.annotation))
    return frozenset(names)


class VLLMEngine:
    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", device: str = "cuda", seed: int = 0,
                 gpu_memory_utilization: float = 0.85, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False) -> None:
        if device != "cuda":
            raise ValueError(f"VLLMEngine.device={device!r}: vLLM runs on CUDA only; use engine 'hf' on CPU")
        # In-process engine core, so weights can be loaded into the model directly (no pickling to workers).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=str(model), dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                       enforce_eager=enforce_eager)
        self.tokenizer = self.llm.get_tokenizer()
        self._version = 0
        self._lock = threading.Lock()
        self._staged: tuple[dict[str, torch.Tensor], int] | None = None
        self._specs = self.llm.apply_model(
            lambda m: {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()})[0]

    @property
    def policy_version(self) -> int:
        return self._version

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"VLLMEngine.load_weights: version={version!r}: must be an int >= 0")
        items = list(state_dict.items())
        # vLLM's own loader maps HF names onto its fused parameters (qkv, gate_up) and checks them.
        with self._lock:
            self.llm.apply_model(lambda m: m.load_weights(weights=iter(items)))
            self._version = version

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._staged = (state_dict, version)

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if params.temperature not in (0.0, 1.0):
            raise ValueError(f"SamplingParams.temperature={params.temperature}: the vllm engine supports 1.0 (and 0.0 "
                             "for greedy) because vLLM's log-probs are those of the raw logits")
        staged, self._staged = self._staged, None
        if staged is not None:
            self.load_weights(*staged)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for index, row in enumerate(ids):
            if not row:
                raise ValueError(f"VLLMEngine.generate: prompt {index} is empty; a prompt needs at least one token")
        sampling = VLLMSamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_tokens,
                                      stop_token_ids=params.stop_token_ids or None, seed=params.seed, logprobs=0)
        version = self._version
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=row) for row in ids], sampling, use_tqdm=False)
        results = []
        for row, output in zip(ids, outputs):
            group = []
            for sample in output.outputs:
                token_ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]
                group.append(Completion(prompt_ids=row, token_ids=token_ids, text=sample.text, logprobs=logprobs,
                                        finish_reason="stop" if sample.finish_reason == "stop" else "length",
                                        policy_versions=[version] * len(token_ids)))
            results.append(group)
        return results
