"""bench.publish_to_ready: the forge weight path from a trainer's model to a generator's copy, on CPU with
the tiny shape (the same code runs on CUDA with the real shapes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.publish_to_ready import build_model, publish_and_load, published_state_dict, qwen3_config
from forge.job import job_id
from forge.weights.segment import SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["device->host", "checksum", "write", "read", "host->device", "load"]


def test_the_generator_copy_equals_the_source_cast_to_the_generator_dtype():
    config = qwen3_config("tiny")
    source = build_model(config, torch.float32, torch.device("cpu"), seed=0)  # fp32 trainer, bf16 generator
    target = build_model(config, torch.bfloat16, torch.device("cpu"), seed=None)
    stages = publish_and_load(source, target, torch.bfloat16)
    assert list(stages.seconds) == STAGES and all(s >= 0 for s in stages.seconds.values())
    expected = source.state_dict()
    for name, tensor in target.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    assert "lm_head.weight" not in published_state_dict(source)  # tied: published once, as the trainer does
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert list(SHM_DIR.glob(f"forge-{job_id()}-bench-*")) == []  # the segment is gone


def test_the_shapes_are_qwen3s_parameter_counts():
    """Qwen3-1.7B: 1.7B parameters, 1.4B without embeddings; Qwen3-8B: 8.2B and 6.95B (their model cards)."""
    from transformers import AutoModelForCausalLM

    for shape, total, non_embedding in (("qwen3-1.7b", 1.72e9, 1.41e9), ("qwen3-8b", 8.19e9, 6.95e9)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(qwen3_config(shape))
        embeddings = model.model.embed_tokens.weight.numel() * (1 if model.config.tie_word_embeddings else 2)
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - total) < 0.01e9 and abs(count - embeddings - non_embedding) < 0.01e9, shape


def test_an_unknown_shape_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"--model-shape='qwen3-0.6b': must be one of \['qwen3-1.7b', 'qwen3-8b', 'tiny'\]"):
        qwen3_config("qwen3-0.6b")


def test_the_command_prints_every_stage_and_both_references_with_ratios_and_leaves_no_file():
    job = f"{os.getpid()}"  # names the bench's shared-memory files
    result = subprocess.run([sys.executable, "-m", "bench.publish_to_ready", "--model-shape", "tiny",
                             "--trainer-dtype", "float32"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "FORGE_JOB_ID": job})
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(SHM_DIR.glob(f"forge-{job}-bench-*")) == []
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for stage in [*STAGES, "total"]:
        assert stage in rows, result.stdout
    assert len(rows["total"].split()) == 4  # total: seconds, GB/s, and the first publish's seconds beside
    assert "total / raw copy =" in result.stdout and "total / torch.save+load =" in result.stdout
    assert "the generator copy equals the published weights after each way" in result.stdout
