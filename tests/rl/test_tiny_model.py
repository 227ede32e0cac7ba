import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

import pytest

from rl.tiny_model import EOS_TOKEN, build_tiny_checkpoint, ensure_tiny_checkpoint, write_tiny_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def test_checkpoint_loads_through_auto_classes_bit_identically(checkpoint, tmp_path):
    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert isinstance(model, Qwen3ForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # nothing re-initialised on load
    assert model.config.vocab_size == len(tokenizer)
    assert not model.config.tie_word_embeddings
    assert 200_000 < model.num_parameters() < 1_000_000

    # The same seed builds the same weights; a different seed does not.
    same = AutoModelForCausalLM.from_pretrained(build_tiny_checkpoint(tmp_path / "same", seed=0))
    other = AutoModelForCausalLM.from_pretrained(build_tiny_checkpoint(tmp_path / "other", seed=1))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, same.state_dict()[name]), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_build_leaves_the_global_rng_alone(tmp_path):
    state = torch.get_rng_state()
    build_tiny_checkpoint(tmp_path / "ckpt", seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_model_overrides_apply_and_unknown_ones_are_refused(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_checkpoint(tmp_path / "deep", num_hidden_layers=3))
    assert len(model.model.layers) == 3
    with pytest.raises(ValueError, match="num_layerz"):
        build_tiny_checkpoint(tmp_path / "bad", num_layerz=3)


@pytest.mark.parametrize("text", ["12+34=46", "Hello, World!  two  spaces\nnew line", " x-1=y , z . ", "a"])
def test_tokenizer_round_trips_text_one_token_per_character(checkpoint, text):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = tokenizer.encode("1+1=2" + EOS_TOKEN)
    assert ids[-1] == tokenizer.eos_token_id and len(ids) == 6  # the EOS text is one token
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+1=2"
    assert tokenizer.encode("1€")[-1] == tokenizer.unk_token_id


def test_ensure_builds_once_then_reuses(tmp_path):
    path = ensure_tiny_checkpoint(tmp_path / "ckpt")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folder left behind
    AutoModelForCausalLM.from_pretrained(path)


def test_ensure_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ensure_tiny_checkpoint(tmp_path / "ckpt")


def test_the_config_checked_before_building_is_the_built_checkpoints(tmp_path):
    """Jobs are validated against `write_tiny_config` on a first run: it must say what the checkpoint will say."""
    written = json.loads((write_tiny_config(tmp_path / "config-only") / "config.json").read_text())
    built = json.loads((ensure_tiny_checkpoint(tmp_path / "ckpt") / "config.json").read_text())
    assert {key: built.get(key) for key in written} == written
