"""Behaviour log-probs of the hf engine (actors/engines/hf.py, sampled with a KV cache) against the trainer's
teacher-forced log-probs (TitanTrainer.logprobs -> actors.logprobs.token_logprobs on the torchtitan model) on CUDA,
same weights, same tokens, in fp32 and bf16. The numbers are measured by bench/gpu_checks.py (docs/gpus.md).

Tolerances come from the H100 run (docs/benchmarks.md, "On one H100"; max and mean over ~700 sampled tokens per
case). fp32 differs by float rounding only (other kernels, another summation order): measured max 1.2e-5, mean
2.3e-6; the bounds (1e-4, 1e-5) leave 4-8x for another card or library version and still fail on any real mismatch
(a wrong temperature or kept set moves log-probs by 1e-2 or more). bf16 differs by the rounding of activations in
two different models (engine: bf16 weights end to end; trainer: fp32 weights under bf16 autocast): measured engine
vs trainer max 0.19, mean 0.030, engine decode vs its own teacher-forced pass max 0.115, mean 0.010; the bounds are
2x those (a maximum over a few hundred tokens is a tail figure: other kernels sample other tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_checks import SAMPLINGS, build_parity_checkpoint, logprob_parity, parity_prompts
from rl.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (max, mean) of |engine - trainer| and of |engine - the engine's model teacher-forced|, per dtype.
TRAINER_TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (0.4, 0.06)}
FORWARD_TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (0.25, 0.02)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_parity_checkpoint(tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_logprobs_equal_the_trainers_teacher_forced_ones(checkpoint: Path, dtype: str, sampling: str) -> None:
    parity = logprob_parity(checkpoint, device="cuda", dtype=dtype, sampling=sampling)
    assert parity.tokens > 500  # 16 completions of up to 48 tokens: a stop token ends few of them
    max_diff, mean_diff = TRAINER_TOLERANCE[dtype]
    assert parity.trainer_max <= max_diff and parity.trainer_mean <= mean_diff, parity
    max_diff, mean_diff = FORWARD_TOLERANCE[dtype]
    assert parity.forward_max <= max_diff and parity.forward_mean <= mean_diff, parity


def test_a_seeded_batch_samples_the_same_tokens_twice_on_cuda(checkpoint: Path) -> None:
    from actors.engines.hf import HFEngine

    engine = HFEngine(checkpoint, dtype="bfloat16", device="cuda", kv_reuse_tokens=0)
    assert engine.device.type == "cuda"
    params = SamplingParams(n=2, max_tokens=24, seed=7, temperature=1.0)
    first, second = (engine.generate(parity_prompts(), params) for _ in range(2))
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in second]
    assert len({tuple(c.token_ids) for g in first for c in g}) > 1  # sampled, not one sequence repeated
