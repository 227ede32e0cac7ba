"""bench.distill_vs_grpo reads a run's held-out curve from the app's own files: the evaluation after step k is in
metrics.jsonl's row k+1 (the app logs a step's metrics before evaluating), the start and the end in summary.json."""

from __future__ import annotations

import pytest

import json
from pathlib import Path

from bench.distill_vs_grpo import first_step_at, read_run, seconds_to, verdict

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process


def fake_run(folder: Path, evals: dict[int, float], steps: int, start: float, end: float) -> Path:
    """summary.json and metrics.jsonl as apps.grpo writes them, with eval/accuracy one row after its step."""
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"steps": steps, "accuracy_start": start, "accuracy_end": end}))
    rows = [{"step": step, "step_s": 0.5} for step in range(1, steps + 1)]
    rows[0]["eval/accuracy"] = start  # the evaluation at the start, recorded before step 1
    for step, accuracy in evals.items():
        rows[step]["eval/accuracy"] = accuracy  # row step+1
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_the_curve_puts_each_evaluation_at_the_step_it_followed(tmp_path):
    run = fake_run(tmp_path / "run", {10: 0.30, 20: 0.55}, steps=30, start=0.15, end=0.70)
    summary, curve, step_seconds = read_run(run)
    assert summary["steps"] == 30
    assert curve == {0: 0.15, 10: 0.30, 20: 0.55, 30: 0.70}
    assert seconds_to(step_seconds, 20) == 10.0 and seconds_to(step_seconds, None) is None


def test_the_first_step_at_a_target_is_the_first_evaluation_at_or_above_it():
    curve = {0: 0.15, 10: 0.50, 20: 0.45, 30: 0.70}
    assert first_step_at(curve, 0.5) == 10
    assert first_step_at(curve, 0.7) == 30
    assert first_step_at(curve, 0.71) is None


def row(distill_at: int | None, grpo_at: int | None, grpo_steps: int = 150) -> dict:
    return {"distill": {"at": distill_at}, "grpo": {"at": grpo_at, "steps": grpo_steps}}


def test_the_goals_need_every_seed_at_the_target_and_a_median_third_of_grpos_steps():
    assert verdict([row(30, 120), row(40, 110), row(20, 100)])[0]  # ratios 0.25, 0.36, 0.2: median 0.25
    ok, line = verdict([row(30, 120), row(60, 110), row(50, 100)])  # median 0.5
    assert not ok and "median distillation / GRPO steps 0.50" in line
    ok, line = verdict([row(10, 120), row(None, 110), row(10, 100)])  # one seed never reaches it
    assert not ok and "on 2 of 3 seeds" in line
    # GRPO not reaching the target in its 150 steps counts as needing more: 40 / 151.
    assert verdict([row(40, None)])[0]


def test_without_grpo_on_every_seed_the_goals_are_not_called_met():
    ok, line = verdict([row(30, 120), {"distill": {"at": 20}}])
    assert not ok and "not both run on every seed" in line


@pytest.mark.parametrize("argv, steps", [([], []), (["--distill-steps", "40", "--grpo-steps", "90"], ["steps=40"])])
def test_each_method_runs_its_configs_steps_unless_the_command_line_sets_them(tmp_path, monkeypatch, argv, steps):
    """configs/distill_tiny.yaml's `steps` is the default's run length (issue 55: a bench default of its own ran the
    distillation shorter than the config)."""
    import bench.distill_vs_grpo as bench

    calls = {}

    def run_app(config, run_dir, overrides, args):
        calls[config] = overrides
        return {}, {0: 0.1, 10: 0.8}, [1.0] * 10

    monkeypatch.setattr(bench, "run_app", run_app)
    monkeypatch.setattr(bench, "teacher_and_sft", lambda seed, sft_steps, args: (0.8, {0: 0.1}, []))
    bench.main(["--seeds", "3", "--methods", "distill", "grpo", "--run-dir", str(tmp_path), *argv, "x=1"])
    distill = calls["configs/distill_tiny.yaml"]
    assert [o for o in distill if o.startswith("steps=")] == steps and distill[-1] == "x=1"
    grpo = [o for o in calls["configs/grpo_tiny.yaml"] if o.startswith("steps=")]
    assert grpo == ([] if not argv else ["steps=90"])
