"""A task from the field's libraries trains through the app by name: reasoning-gym's, from the command line (with
the weight-sync canary checking every version the generators serve)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.monarch, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


def test_a_reasoning_gym_task_trains_by_name(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"run_dir={run_dir}", "steps=2",
               "task.source=reasoning_gym", "task.name=basic_arithmetic", "task.size=200", "task.held_out=16",
               "++task.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
               "warm_start.enabled=false", "eval.num_prompts=16", "rollout.concurrency=2", "replay_buffer.batch_size=16",
               "trainer.micro_batch_size=16", "checkpoint.final=false", "canary.every=1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)
    assert all(r["canary/logprob_diff"] < 1e-4 for r in rows)  # fp32 trainer and generator
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"]["trained"] >= 32
