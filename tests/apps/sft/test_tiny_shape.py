"""`tiny_shape`: apps.sft trains a tiny model of another shape (docs/sft.md, SFT then GRPO on a reasoning-gym task),
built once per shape into model_cache; a bad shape is refused naming the field before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.sft.cli import load_sft_config
from forge.config import ConfigError
from rl.tiny_model import TINY_CHECKPOINT_DIR

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/sft_tiny.yaml")


def test_a_shape_builds_its_own_checkpoint_of_that_shape(tmp_path):
    shape = ["tiny_shape.hidden_size=64", "tiny_shape.num_hidden_layers=3"]
    cfg, _ = load_sft_config(["--config", TINY, f"model_cache={tmp_path}", *shape])
    folder = Path(cfg.trainer.model_path)
    assert folder.parent == tmp_path and folder.name.startswith(f"{TINY_CHECKPOINT_DIR}-")
    assert cfg.generator.model == cfg.model == str(folder)  # ${model} follows the shaped checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (64, 3, 384)
    other, _ = load_sft_config(["--config", TINY, f"model_cache={tmp_path}", "tiny_shape.hidden_size=64"])
    assert other.model != cfg.model  # another shape, another folder
    again, _ = load_sft_config(["--config", TINY, f"model_cache={tmp_path}", *reversed(shape)])
    assert again.model == cfg.model  # the same shape, whatever the order of its keys


@pytest.mark.parametrize(("override", "message"), [
    ("tiny_shape.hidden=64", r"^tiny_shape.hidden=64: not a shape field of the tiny model; allowed: hidden_size,"),
    ("tiny_shape.num_hidden_layers=0", r"^tiny_shape.num_hidden_layers=0: must be a positive integer"),
    ("tiny_shape.tie_word_embeddings=1", r"^tiny_shape.tie_word_embeddings=1: must be true or false"),
    ("tiny_shape.num_attention_heads=3", r"^tiny_shape: num_attention_heads=3 must be a multiple of num_key_value_heads=2"),
    # the whole job is checked against the shape's config.json before its checkpoint is built
    ("tiny_shape.num_attention_heads=6 tiny_shape.num_key_value_heads=3 trainer.tensor_parallel_degree=2",
     r"^trainer.model_path='.*' with resources.trainer_procs=2: tensor_parallel_degree=2: must divide config.json "
     r"num_key_value_heads=3"),
])
def test_a_bad_shape_is_refused_naming_it_before_anything_is_built(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_sft_config(["--config", TINY, f"model_cache={tmp_path}", *override.split()])
    assert not list(tmp_path.iterdir())


def test_a_shape_needs_the_tiny_model(tmp_path):
    with pytest.raises(ConfigError, match=r"^tiny_shape=\{'hidden_size': 64\}: shapes the tiny model only"):
        load_sft_config(["--config", TINY, f"model={tmp_path}", "tiny_shape.hidden_size=64"])
