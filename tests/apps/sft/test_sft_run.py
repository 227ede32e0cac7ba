"""`python -m apps.sft` end to end on the tiny model (HEAVY: Monarch processes; the trainer on 2 FSDP ranks and a
generator service). One run of 6 steps, then a second that resumes from its step-3 checkpoint (the same checkpoints
as apps.grpo's): the held-out loss falls, the accuracy is measured, the HF export loads, and the resumed run ends
with exactly the weights of the uninterrupted one (trainer, optimizer, LR schedule and data position restored)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

REPO = Path(__file__).resolve().parents[3]
STEPS = 6


def sft(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "apps.sft", "--config", "configs/sft_tiny.yaml", f"run_dir={run_dir}",
               f"steps={STEPS}", "trainer.warmup_steps=2", "checkpoint.interval=3", "eval.num_prompts=32",
               "metrics.console=false", *extra]
    try:
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"apps.sft ran past 240 s:\n{e.stdout}\n{e.stderr}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    whole = sft(root / "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    resumed_dir = root / "resumed"
    shutil.copytree(root / "whole/checkpoints/step_000003", resumed_dir / "checkpoints/step_000003")
    resumed = sft(resumed_dir, "generator=null", "eval.at_start=false", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return root, whole, resumed


def test_the_held_out_loss_falls_and_the_accuracy_is_measured(runs):
    root, whole, _ = runs
    summary = json.loads((root / "whole/summary.json").read_text())
    assert summary["steps"] == STEPS and summary["interrupted"] is None
    assert summary["end"]["eval/loss"] < summary["start"]["eval/loss"] - 0.5, summary
    assert 0 <= summary["start"]["eval/accuracy"] <= 1 and 0 <= summary["end"]["eval/accuracy"] <= 1
    records = [json.loads(line) for line in (root / "whole/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in steps)
    evaluations = [r for r in records if "eval/loss" in r]  # at the start and the end, beside the training steps
    assert [(r["step"], r["eval/loss"], r["eval/accuracy"]) for r in evaluations] == [
        (0, summary["start"]["eval/loss"], summary["start"]["eval/accuracy"]),
        (STEPS, summary["end"]["eval/loss"], summary["end"]["eval/accuracy"])]


def test_the_hf_export_loads_and_generates(runs):
    root, _, _ = runs
    model = AutoModelForCausalLM.from_pretrained(root / "whole/hf_model")
    out = model.generate(torch.tensor([[4, 5, 75, 6, 7, 83]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 8)


def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_one(runs):
    root, _, resumed = runs
    assert f"resumed from {root}/resumed/checkpoints/step_000003: step 3" in resumed.stdout
    whole = load_file(root / "whole/hf_model/model.safetensors")
    again = load_file(root / "resumed/hf_model/model.safetensors")
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    start = load_file(REPO / ".cache/forge/tiny-qwen3/model.safetensors")
    assert not all(torch.equal(whole[k], start[k]) for k in whole)  # it trained


def test_a_packed_run_trains_the_same_steps_with_less_padding(runs):
    root, _, _ = runs
    packed = sft(root / "packed", "packing.enabled=true", "packing.max_length=40", "generator=null",
                 "eval.at_start=false", "checkpoint.interval=0")
    assert packed.returncode == 0, packed.stdout[-3000:] + packed.stderr[-3000:]

    def steps(run: str) -> list[dict]:
        return [r for r in map(json.loads, (root / run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    whole, again = steps("whole"), steps("packed")
    # The same examples each step, each attending only to itself: the same losses up to float rounding (RoPE sees
    # the same distances at other absolute positions); a packed row without its document mask would differ.
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in whole], rel=1e-4)
    # Rows of 40 tokens hold four examples of 8-10 tokens (2-digit sums): less padding over the run than rows as long
    # as each batch's longest (a step can tie).
    assert sum(r["pad_fraction"] for r in again) < sum(r["pad_fraction"] for r in whole) - 0.05
