"""One forge trainer step (actors.titan_trainer.TitanTrainer: torchtitan Qwen3, GRPO, micro-batched exact gradient
accumulation, fused AdamW) on CUDA against the same step on CPU in fp32: loss, gradient norm and the log-probs after
the step. No Monarch: the trainer actor only wraps this class.

Tolerances from the H100 run (docs/gpus.md; every figure in docs/benchmarks.md, "On one H100"). fp32 on CUDA differs
from CPU by float rounding: measured |d loss| 3e-8, grad norm 1e-6 relative, log-probs after the step 9e-6; bounds
about 10x-30x that. bf16 autocast differs by the rounding of activations: measured |d loss| 1.5e-3 (loss 0.18), grad
norm 2.0% relative, log-probs after 0.096; bounds 2-3x that, still far under what a wrong loss, mask or gradient
moves (1e-1 and more)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_checks import build_parity_checkpoint, step_batch, trainer_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# |loss - cpu|, |grad_norm - cpu| / cpu, max |log-prob after the step - cpu|
TOLERANCE = {"float32": (1e-6, 1e-5, 1e-4), "bfloat16": (5e-3, 0.05, 0.2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_parity_checkpoint(tmp_path_factory.mktemp("step"))


@pytest.fixture(scope="module")
def cpu_step(checkpoint: Path) -> dict:
    return trainer_step(checkpoint, device="cpu", dtype="float32", batch=step_batch())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cuda_step_equals_the_cpu_fp32_step(checkpoint: Path, cpu_step: dict, dtype: str) -> None:
    batch = step_batch()
    step = trainer_step(checkpoint, device="cuda", dtype=dtype, batch=batch)
    loss_tol, grad_norm_rtol, after_tol = TOLERANCE[dtype]
    assert abs(step["loss"] - cpu_step["loss"]) <= loss_tol, (step["loss"], cpu_step["loss"])
    assert abs(step["grad_norm"] - cpu_step["grad_norm"]) <= grad_norm_rtol * cpu_step["grad_norm"]
    after = (step["logprobs_after"] - cpu_step["logprobs_after"])[batch.response_mask > 0].abs().max()
    assert float(after) <= after_tol
    assert step["policy_version"] == 1
