"""apps.grpo on a multi-turn task (configs/multiturn_tiny.yaml, shortened): a user's command, then assertions on
what it wrote. The brief warm start teaches the tool-call format, so episodes take several model turns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.monarch, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


def test_multi_turn_grpo_trains_on_episodes_of_several_turns(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/multiturn_tiny.yaml", f"run_dir={run_dir}",
               f"model_cache={tmp_path / 'cache'}", "steps=3", "warm_start.max_steps=60", "warm_start.eval_every=60",
               "warm_start.eval_prompts=16", "task.held_out=32", "eval.num_prompts=32", "rollout.concurrency=4",
               "replay_buffer.batch_size=64", "trainer.micro_batch_size=64", "checkpoint.interval=0",
               "checkpoint.final=false", "canary.every=1",
               # A 60-step warm start is rarely right, so most groups are all wrong: past 4 dropped groups a step
               # keeps them, and the run is not held up waiting for rare groups with a right episode.
               "rollout.max_dropped_groups_per_step=4"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The warm start taught the tool call: episodes ask, read the reply, then answer (2 model turns).
    turns = [r["env/model_turns"] for r in rows if "env/model_turns" in r]
    assert turns and min(turns) > 1.5, turns
    assert all(r["canary/logprob_diff"] < 1e-4 for r in rows)  # the generators serve the trained weights
    assert "held-out greedy accuracy" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    episodes = summary["episodes"]
    assert episodes["trained"] == 3 * 64
    # Dynamic sampling's budget: at most 4 groups of 8 dropped per step (and after the last one, while it stops).
    assert episodes["dropped_zero_variance"] <= (3 + 1) * 4 * 8, episodes
