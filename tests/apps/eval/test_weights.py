"""A step checkpoint read as Hugging Face weights on its base model: exactly the weights it was saved from; one of
another shape, or LoRA adapters without their base, refused naming the checkpoint (no actors)."""

import pytest
import torch
from safetensors.torch import load_file

from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from apps.eval.weights import check_fits, load_weights
from rl.tiny_model import build_tiny_checkpoint


def test_a_checkpoint_reads_back_as_the_hf_weights_it_was_saved_from(tiny_run):
    expected = load_file(tiny_run.other / "model.safetensors")
    weights = load_weights(str(tiny_run.step(2) / "trainer"), str(tiny_run.base))
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    check_fits(str(tiny_run.step(2) / "trainer"), str(tiny_run.base))


def test_a_checkpoint_of_another_shape_is_refused(tiny_run, tmp_path):
    wider = build_tiny_checkpoint(tmp_path / "wider", hidden_size=64, head_dim=16)
    with pytest.raises(ValueError, match=r"checkpoint .*step_000002/trainer does not fit model='.*wider'.*other "
                                         r"shapes \['lm_head.weight', 'model.embed_tokens.weight'"):
        check_fits(str(tiny_run.step(2) / "trainer"), str(wider))


def test_lora_adapters_without_their_base_are_refused(tiny_run, tmp_path):
    config = TrainerConfig(model_path=str(tiny_run.base), lora={"rank": 4, "alpha": 8.0})
    TitanTrainer(config).save_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(trained with trainer.lora\)"):
        check_fits(str(tmp_path / "lora"), str(tiny_run.base))
