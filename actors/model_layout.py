"""Whether torchtitan can build and shard a Hugging Face checkpoint, judged from its config.json alone.

Plain Python (no torch, no TorchTitan): apps check a job's layout before its training stack is imported (their
config's check step, on the config.json that model_files.py reads), and the trainer makes the same checks when it
builds the model (actors/model_builder.py).
"""

from __future__ import annotations

from typing import Any

# The HF `model_type` each family's torchtitan model and state-dict adapter reproduce.
HF_MODEL_TYPES = {"qwen3": "qwen3", "llama3": "llama"}
# The config.json keys torchtitan's model configuration is made from (a missing one is a KeyError naming it); the
# RoPE base is `rope_theta` too, read by `rope_settings` from where the config's transformers version put it.
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "rms_norm_eps",
                 "max_position_embeddings", "intermediate_size")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_settings(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) of a config.json in either form: transformers 5 writes
    `rope_parameters: {rope_theta, rope_type, ...}`, earlier releases a top-level `rope_theta` and `rope_scaling`
    (checkpoints on the hub and saved by older code still carry that form)."""
    parameters = hf_config.get("rope_parameters")
    if parameters is not None:
        if "rope_theta" not in parameters:
            raise KeyError("rope_parameters.rope_theta")
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        scaling = None if scaling.get("rope_type", "default") == "default" else scaling
        return float(parameters["rope_theta"]), scaling
    if "rope_theta" not in hf_config:
        raise KeyError("rope_theta")
    return float(hf_config["rope_theta"]), hf_config.get("rope_scaling")


def check_hf_config(family: str, hf_config: dict[str, Any]) -> None:
    """Refuse a config.json that torchtitan's `family` model cannot reproduce."""
    model_type = hf_config.get("model_type")
    if model_type != HF_MODEL_TYPES[family]:
        raise ValueError(f"config.json model_type={model_type!r} is not family {family!r}; "
                         f"that family needs model_type {HF_MODEL_TYPES[family]!r}")
    for key in REQUIRED_KEYS:
        if key not in hf_config:
            raise KeyError(key)
    for key, supported in (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False)):
        if hf_config.get(key, supported) != supported:
            raise ValueError(f"config.json {key}={hf_config[key]!r}: torchtitan's {family} supports only {supported}")
    _, rope_scaling = rope_settings(hf_config)
    if family == "qwen3":
        if rope_scaling is not None:
            raise ValueError(f"config.json rope_scaling={rope_scaling!r}: torchtitan's qwen3 supports only None")
        return
    if hf_config.get("tie_word_embeddings", False):
        raise ValueError("config.json tie_word_embeddings=True: forge's llama3 has no weight tying")
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        raise ValueError(f"config.json head_dim={head_dim}: torchtitan's llama3 needs hidden_size / "
                         f"num_attention_heads = {dim // n_heads}")
    if rope_scaling is not None and rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"config.json rope_scaling={rope_scaling!r}: torchtitan's llama3 supports None or "
                         "rope_type 'llama3'")
    for key in LLAMA3_ROPE_KEYS if rope_scaling is not None else ():
        if key not in rope_scaling:
            raise KeyError(f"rope_scaling.{key}")


def check_parallel_layout(hf_config: dict[str, Any], world_size: int, tensor_parallel_degree: int = 1) -> None:
    """Whether the model can be sharded over `world_size` ranks (FSDP, times TP)."""
    if hf_config.get("tie_word_embeddings", False) and world_size > 1:
        # torchtitan 0.2.0's parallelize_fn tied on the meta device and the tie did not survive materialization
        # (pytorch/torchtitan#2252): the output layer trained as a separate, stale copy. 0.3.0 re-ties in
        # init_states; until a sharded tied run is tested against one rank, forge keeps refusing it.
        raise ValueError(f"config.json tie_word_embeddings=True with world_size={world_size}: "
                         "forge does not shard tied embeddings (untested on torchtitan 0.3.0); use one rank or an "
                         "untied checkpoint")
    if world_size % tensor_parallel_degree:
        raise ValueError(f"world_size={world_size}: must be a multiple of "
                         f"tensor_parallel_degree={tensor_parallel_degree}")
    n_heads = hf_config["num_attention_heads"]
    for field, heads in (("num_attention_heads", n_heads), ("num_key_value_heads",
                                                              hf_config.get("num_key_value_heads") or n_heads)):
        if heads % tensor_parallel_degree:
            raise ValueError(f"tensor_parallel_degree={tensor_parallel_degree}: must divide config.json "
                             f"{field}={heads} (each rank holds whole heads)")
