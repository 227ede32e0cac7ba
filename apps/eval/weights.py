"""A trainer checkpoint (DCP, torchtitan names) as Hugging Face-named weights on its base model, in this process.

The checkpoint's model tensors are read alone (not its optimizer state) and renamed by torchtitan's state-dict
adapter, the one the trainer publishes and exports with, so the result is what `export_hf` would have written.
`check_fits` compares names and shapes from the metadata alone, before anything starts; `load_weights` reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from actors import checkpoint
from actors.model_builder import model_spec, resolve_model_path, state_dict_adapter
from actors.model_layout import HF_MODEL_TYPES


def check_fits(trainer_dir: str, model: str) -> None:
    """Raise ValueError unless the checkpoint's weights have exactly `model`'s HF names and shapes."""
    base = _base_shapes(model)
    tensors = {checkpoint.current_name(k): v for k, v in _model_tensors(trainer_dir, "meta").items()}
    converted = {name: tuple(t.shape) for name, t in _to_hf(tensors, model).items()}
    if converted != base:
        missing, extra = sorted(set(base) - set(converted)), sorted(set(converted) - set(base))
        shapes = sorted(n for n in set(base) & set(converted) if base[n] != converted[n])
        raise ValueError(f"checkpoint {trainer_dir} does not fit model={model!r} (the base it is evaluated on): "
                         f"missing {missing[:3]}, extra {extra[:3]}, other shapes {shapes[:3]}; set model to the run's "
                         "starting model")


def load_weights(trainer_dir: str, model: str) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights in HF names (size and CRC32 of every file checked first)."""
    states = _model_tensors(trainer_dir, "cpu")
    checkpoint.load(states, Path(trainer_dir), rank=0, world_size=1)
    return _to_hf({checkpoint.current_name(k): v for k, v in states.items()}, model)


def _model_tensors(trainer_dir: str, device: str) -> dict[str, torch.Tensor]:
    """Empty tensors for the checkpoint's model keys (the top-level tensors that are not the trainer's other parts),
    under the checkpoint's own names (torchtitan 0.2.0's in one written by forge before torchtitan 0.3.0)."""
    metadata = FileSystemReader(trainer_dir).read_metadata().state_dict_metadata
    if any(key.split(".")[0] == "lora" for key in metadata):
        raise ValueError(f"checkpoint {trainer_dir} holds LoRA adapters (trained with trainer.lora) without their "
                         "base: apps.eval evaluates full-weight checkpoints")
    return {key: torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
            for key, meta in metadata.items()
            if isinstance(meta, TensorStorageMetadata) and checkpoint.is_model_key(key)}


def _to_hf(states: dict[str, torch.Tensor], model: str) -> dict[str, torch.Tensor]:
    hf_config = json.loads((resolve_model_path(model) / "config.json").read_text())
    family = {v: k for k, v in HF_MODEL_TYPES.items()}.get(hf_config.get("model_type"))
    if family is None:
        raise ValueError(f"model={model!r}: config.json model_type={hf_config.get('model_type')!r} is not one the "
                         f"trainer trains ({', '.join(HF_MODEL_TYPES.values())})")
    # torchtitan 0.3.0 names (checkpoint.current_name); the adapter leaves a tied lm_head out, as HF checkpoints do.
    return state_dict_adapter(model_spec(family, hf_config)).to_hf(states)


def _base_shapes(model: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(resolve_model_path(model).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes
