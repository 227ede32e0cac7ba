"""The generator's settings and their checks, in plain Python: no torch, no Monarch.

A job's config is checked before its training stack is imported (apps/grpo/cli.py), so the config schema must not
pull that stack in; `actors.generator` (the actor) and `actors.engines` build on this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE_KINDS = ("hf", "vllm")


# The hf engine's arguments a config may set (actors.engines.hf.HFEngine); vllm's are checked by vllm_args.
HF_ENGINE_ARGS = ("kv_reuse_tokens",)


@dataclass
class GeneratorConfig:
    """A generator: its engine, and how it batches requests and follows published weights."""

    model: str = "???"
    """HF checkpoint directory or hub id (apps: `${model}`)."""
    engine: str = "hf"
    """`hf` (transformers) or `vllm` (vLLM's AsyncLLM, continuous batching); both on CPU or GPU. The tiny configs
    use hf, the Qwen3 ones vllm."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    device: str = "cpu"
    """cpu or cuda."""
    seed: int = 0
    """Sampling seed."""
    max_batch_size: int = 256
    """Sequences (prompts x n) per engine call: concurrent requests are batched into one."""
    batch_wait_s: float = 0.002
    """How long a request waits for company before the batch runs."""
    weight_poll_s: float = 0.05
    """How often the weight store is checked for a newer version."""
    torch_threads: int = 1
    """CPU threads per generator process (0: torch's default)."""
    weight_namespace: str = "policy"
    """The weight store namespace whose versions this generator loads."""
    engine_args: dict = field(default_factory=dict)
    """The engine's own arguments. vLLM: passed through (`max_model_len`, `enforce_eager`, `tensor_parallel_size`,
    ...); a key vLLM does not have, or one forge sets, is refused before anything starts. hf: `kv_reuse_tokens`
    (65536: tokens of past key values kept for later turns; 0: none)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine={self.engine!r}: must be one of {', '.join(ENGINE_KINDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: must be 'cpu' or 'cuda'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: must be one of float32, bfloat16, float16")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if self.batch_wait_s < 0 or self.weight_poll_s <= 0:
            raise ValueError(f"batch_wait_s={self.batch_wait_s}, weight_poll_s={self.weight_poll_s}: "
                             "batch_wait_s must be >= 0 and weight_poll_s > 0")
        if self.engine == "hf":
            unknown = sorted(set(self.engine_args) - set(HF_ENGINE_ARGS))
            if unknown:
                raise ValueError(f"engine_args={self.engine_args}: the hf engine has no {unknown}; it takes "
                                 f"{sorted(HF_ENGINE_ARGS)}")
            reuse = self.engine_args.get("kv_reuse_tokens", 0)
            if not isinstance(reuse, int) or isinstance(reuse, bool) or reuse < 0:
                raise ValueError(f"engine_args.kv_reuse_tokens={reuse!r}: must be an int >= 0 (0 = no KV reuse)")
