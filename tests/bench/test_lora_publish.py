"""bench.lora_publish on the tiny shape: the adapter's bytes are what a LoRA trainer publishes, and the generator
copy after the adapter way is exactly a fresh merge (the bench checks it; a wrong merge would fail it)."""

from __future__ import annotations

import torch

from bench.lora_publish import lora_adapter, main, publish_adapter_and_merge
from bench.publish_to_ready import build_model, qwen3_config


def test_adapter_bytes_and_ratios_are_printed(capsys) -> None:
    figures = main(["--model-shape", "tiny", "--rank", "4", "--targets", "q_proj,v_proj", "--repeats", "1"])
    config = qwen3_config("tiny")
    per_layer = 4 * (config.hidden_size + config.num_attention_heads * config.head_dim)  # q: A [4, in] + B [out, 4]
    per_layer += 4 * (config.hidden_size + config.num_key_value_heads * config.head_dim)  # v
    assert figures["adapter_bytes"] == per_layer * config.num_hidden_layers * 2  # bf16
    out = capsys.readouterr().out
    assert "| adapter only |" in out and "x the bytes" in out


def test_merge_is_taken_from_the_kept_base_each_time() -> None:
    config = qwen3_config("tiny")
    source = build_model(config, torch.bfloat16, torch.device("cpu"), seed=0)
    target = build_model(config, torch.bfloat16, torch.device("cpu"), seed=0)
    base = {n: p.detach().clone() for n, p in target.named_parameters() if "q_proj" in n}
    def q_weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in target.named_parameters() if "q_proj" in n}

    runs = []
    for seed in (1, 2, 1):  # the third version is the first again: it must give the first's weights exactly
        publish_adapter_and_merge(lora_adapter(source, 4, ["q_proj"], seed), target, base, torch.bfloat16)
        runs.append(q_weights())
    for name in base:
        assert torch.equal(runs[2][name], runs[0][name]), name
        assert not torch.equal(runs[0][name], base[name]) and not torch.equal(runs[1][name], runs[0][name])
