"""On-policy distillation end to end: the teacher's mesh scores the student's samples and its log-probs drive the
loss. Three runs: configs/distill_tiny.yaml (single-turn) with the TorchTitan teacher (the sampled tokens' k1 KL, and
the exact per-position KL over its top-k: kl=reverse), and the multi-turn lookup task
(configs/multiturn_tiny.yaml, the environment's tokens masked out of the loss) with the hf engine's."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(600)]


def sharp_teacher(path: Path) -> Path:
    """A tiny model of another shape and seed whose output layer is scaled up: its distribution is far from the
    untrained student's near-uniform one (two untrained tiny models are within a few 1e-4 nats of each other)."""
    import torch
    from safetensors.torch import load_file, save_file

    from rl.tiny_model import build_tiny_checkpoint

    build_tiny_checkpoint(path, seed=1, num_hidden_layers=3)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 200
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})
    assert torch.isfinite(weights["lm_head.weight"]).all()
    return path


MULTI_TURN = ["configs/multiturn_tiny.yaml", "trainer.loss=distill", "rollout.drop_zero_variance_groups=false",
              "~rollout.max_dropped_groups_per_step"]


@pytest.mark.parametrize("engine, config, started", [
    ("titan", ["configs/distill_tiny.yaml", "++trainer.loss_params.kl=sampled", "teacher.top_k=0"],
     "replay buffer, teacher\n"),
    ("titan", ["configs/distill_tiny.yaml", "++trainer.loss_params.kl=reverse", "teacher.top_k=100"],
     "replay buffer, teacher\n"),
    ("hf", [*MULTI_TURN, "++trainer.loss_params.kl=sampled", "teacher.top_k=0"],
     "replay buffer, teacher (hf engine)\n"),
], ids=["single-turn-titan", "single-turn-titan-reverse-kl", "multi-turn-hf"])
def test_the_teachers_logprobs_reach_the_loss_as_the_reverse_kl(tmp_path, engine, config, started):
    teacher, run_dir = sharp_teacher(tmp_path / "teacher"), tmp_path / "run"
    # One optimizer step per batch, on policy: at step 1 r_t = 1, and the untrained student's rewards are all 0 (no
    # group advantage), so the loss is the batch's reverse KL over the model's tokens: k1 on the sampled tokens, or
    # (kl=reverse) the exact KL over the teacher's top-100 (the whole 99-token vocabulary) at each position.
    result = subprocess.run(
        [sys.executable, "-m", "apps.grpo", "--config", *config, f"run_dir={run_dir}",
         f"teacher.model={teacher}", f"teacher.engine={engine}", "warm_start.enabled=false", "steps=3",
         "eval.at_start=false", "eval.at_end=false", "eval.every=0", "rollout.concurrency=2", "replay_buffer.batch_size=32", "replay_buffer.max_policy_age=0",
         "trainer.micro_batch_size=32", "trainer.minibatches=1", "checkpoint.final=false", "canary.every=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    assert started in result.stdout  # the teacher's own mesh, not the reference model's
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [row["reverse_kl"] for row in rows]
    assert len(kl) == 3 and all(math.isfinite(k) for k in kl), kl
    # The student scored as its own teacher would give ~1e-6; this teacher is nats away.
    assert kl[0] > 0.5, kl
    assert rows[0]["loss"] == pytest.approx(kl[0], rel=1e-3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["teacher"] == str(teacher)
