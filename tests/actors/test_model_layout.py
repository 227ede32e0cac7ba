"""actors.model_layout: the checks of a config.json against torchtitan's models, in plain Python."""

import subprocess
import sys

import pytest

from actors.model_layout import check_hf_config, check_parallel_layout, rope_settings

QWEN3 = {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "max_position_embeddings": 256, "intermediate_size": 384, "tie_word_embeddings": False}
LLAMA3 = {**QWEN3, "model_type": "llama"}
NO_THETA = {k: v for k, v in QWEN3.items() if k != "rope_theta"}


@pytest.mark.parametrize("family, config, error, message", [
    ("llama3", QWEN3, ValueError, r"model_type='qwen3' is not family 'llama3'"),
    ("qwen3", {**QWEN3, "attention_bias": True}, ValueError, r"attention_bias=True: torchtitan's qwen3 supports only"),
    ("qwen3", {**QWEN3, "rope_scaling": {"rope_type": "yarn"}}, ValueError, r"torchtitan's qwen3 supports only None"),
    ("llama3", {**LLAMA3, "tie_word_embeddings": True}, ValueError, r"llama3 has no weight tying"),
    ("llama3", {**LLAMA3, "head_dim": 64}, ValueError, r"head_dim=64: torchtitan's llama3 needs .* = 32"),
    ("llama3", {**LLAMA3, "rope_scaling": {"rope_type": "yarn"}}, ValueError, r"supports None or rope_type 'llama3'"),
    ("llama3", {**LLAMA3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, KeyError, r"rope_scaling.low_freq"),
    ("qwen3", {k: v for k, v in QWEN3.items() if k != "rope_theta"}, KeyError, r"rope_theta"),
    # transformers 5 writes the RoPE settings under rope_parameters.
    ("qwen3", {**NO_THETA, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, ValueError,
     r"torchtitan's qwen3 supports only None"),
    ("llama3", {**NO_THETA, "model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3",
                                                                       "factor": 8.0}}, KeyError,
     r"rope_scaling.low_freq"),
])
def test_a_config_torchtitan_cannot_reproduce_is_refused(family, config, error, message):
    with pytest.raises(error, match=message):
        check_hf_config(family, config)


def test_the_models_it_can_build_pass():
    check_hf_config("qwen3", QWEN3)
    assert rope_settings({**NO_THETA, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    check_hf_config("llama3", {**NO_THETA, "model_type": "llama", "rope_parameters": {"rope_theta": 5e5, **llama31}})
    assert rope_settings({**NO_THETA, "rope_parameters": {"rope_theta": 5e5, **llama31}}) == (5e5, llama31)
    check_hf_config("llama3", {**LLAMA3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 128}})


@pytest.mark.parametrize("config, world_size, tp, message", [
    ({**QWEN3, "tie_word_embeddings": True}, 2, 1, r"tie_word_embeddings=True with world_size=2"),
    (QWEN3, 3, 2, r"world_size=3: must be a multiple of tensor_parallel_degree=2"),
    (QWEN3, 4, 4, r"tensor_parallel_degree=4: must divide config.json num_key_value_heads=2"),
])
def test_a_layout_that_cannot_shard_the_model_is_refused(config, world_size, tp, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_layout(config, world_size, tp)
    check_parallel_layout({**config, "tie_word_embeddings": False, "num_key_value_heads": 4}, 4, 2)


def test_the_checks_import_neither_torch_nor_torchtitan():
    code = "import sys, actors.model_layout; print(sorted({'torch', 'torchtitan'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_rope_is_read_from_transformers_5s_rope_parameters_and_from_the_older_top_level_keys():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert rope_settings({"rope_theta": 5e5, "rope_scaling": scaling}) == (5e5, scaling)
    assert rope_settings({"rope_parameters": {"rope_theta": 5e5, **scaling}}) == (5e5, scaling)
    assert rope_settings({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)
    with pytest.raises(KeyError, match="rope_parameters.rope_theta"):
        rope_settings({"rope_parameters": {"rope_type": "default"}})
    qwen3 = {k: v for k, v in QWEN3.items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="rope_scaling"):  # a scaled rope in the new form is refused as before
        check_hf_config("qwen3", {**qwen3, "rope_parameters": {"rope_theta": 1e6, **scaling}})
    check_hf_config("qwen3", {**qwen3, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
