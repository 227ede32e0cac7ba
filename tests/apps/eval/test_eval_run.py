"""`python -m apps.eval` end to end on a run directory, through the generator service and the hf engine (HEAVY: one
run for the module), on a single-turn and a multi-turn task. The run (conftest.py) has step 1 = the base model's
weights and step 2 = another model's: with seeded sampling, step 1 must give exactly the base's samples and step 2
others, so each checkpoint's weights were the ones sampled (episodes too, every turn). The results reach the table, results.json, metrics.jsonl and the plot, and no process is left."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import job_processes

REPO = Path(__file__).resolve().parents[3]
PROMPTS, N = 12, 4


@pytest.fixture(scope="module")
def evaluated(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_out")
    command = [sys.executable, "-m", "apps.eval", "--config", "configs/eval_tiny.yaml", f"model={tiny_run.base}",
               f"run_dir={tiny_run.run_dir}", f"output_dir={out}", f"num_prompts={PROMPTS}",
               f"sampling.num_samples={N}", "sampling.pass_k=[1,4]", "sampling.temperature=1.0", "sampling.seed=7",
               # and the multi-turn task: its samples are episodes its environment scores, through the same service
               "tasks=[{name: arithmetic, reverse_answer: true}, {name: lookup, held_out: 50}]",
               "environment.max_turns=3", "environment.max_total_tokens=32",
               "save_samples=true", "progress_every_s=0.01",
               # One prompt in flight: the engine's batches (and so its logits, bit for bit) are the same in every
               # evaluation, so equal weights give equal seeded samples (batched with other prompts, they may not).
               "concurrency=1"]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"apps.eval ran past 300 s:\n{stdout}\n{stderr}")
    return proc, stdout, stderr, out


def test_every_checkpoint_is_evaluated_on_its_own_weights(evaluated):
    proc, stdout, stderr, out = evaluated
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert [(r["label"], r["step"], r["kind"]) for r in results] == [
        ("base", 0, "hf"), ("step_000001", 1, "checkpoint"), ("step_000002", 2, "checkpoint")]
    for r in results:
        for task in ("arithmetic", "lookup"):
            score = r["tasks"][task]
            assert (score["prompts"], score["samples"], score["failed_samples"]) == (PROMPTS, PROMPTS * N, 0)
            assert set(score) >= {"pass@1", "pass@4", "mean_reward"}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    texts = {label: [s["text"] for s in samples if s["version"] == label] for label in ("base", "step_000001",
                                                                                       "step_000002")}
    assert all(len(t) == 2 * PROMPTS * N for t in texts.values())
    assert texts["step_000001"] == texts["base"]  # the same weights, the same seeds: the same samples
    assert texts["step_000002"] != texts["base"]  # another model's weights were swapped in


def test_the_report_reaches_the_console_the_metrics_and_the_plot(evaluated):
    proc, stdout, stderr, out = evaluated
    assert proc.returncode == 0
    assert "pass@4" in stdout and "step_000002  arithmetic" in stdout  # the table
    assert f"eval step_000002 arithmetic: {PROMPTS}/{PROMPTS} prompts" in stdout  # each task's last progress line
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2] and "eval/arithmetic/pass@4" in metrics[0]
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert job_processes(proc.pid) == []
