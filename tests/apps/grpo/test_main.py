"""apps.grpo end to end, as a user runs it: a subprocess, then assertions on what it wrote."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import marked_environment, processes_with_mark

# Whole-app runs: on a loaded 2-core host Monarch start-up alone has taken minutes.
pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


def _grpo_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"run_dir={run_dir}",
            "warm_start.enabled=false", "eval.num_prompts=32", "rollout.concurrency=2",
            "replay_buffer.batch_size=32", "trainer.micro_batch_size=32", *overrides]


def _run_grpo(run_dir: Path, *overrides: str, timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    """Run the app to the end and require exit code 0."""
    result = subprocess.run(_grpo_command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, **popen)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_300_step_run_writes_its_metrics_keeps_memory_flat_and_accounts_for_every_episode(tmp_path):
    # One run for the end-to-end checks and the soak: an app start costs more here than a hundred tiny steps.
    run_dir = tmp_path / "run"
    steps = 300
    result = _run_grpo(run_dir, f"steps={steps}", "replay_buffer.max_policy_age=1", timeout=900,
                       env=marked_environment(str(run_dir)))
    assert "=== GRPO run summary ===" in result.stdout
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [int(r["policy_version"]) for r in rows] == list(range(1, steps + 1))  # one published version per step
    assert sum(r.get("generator/weight_swaps", 0) for r in rows) >= 2  # generators swapped in new weights
    assert all(r["train/version_lag"] <= 1 for r in rows)  # max_policy_age=1 held for every trained batch
    assert all("reward/mean" in r and "loss" in r and "grad_norm" in r for r in rows)
    assert (run_dir / "hf_model" / "model.safetensors").exists()
    assert not processes_with_mark(str(run_dir))

    summary = json.loads((run_dir / "summary.json").read_text())
    start, end = summary["rss_start"], summary["rss_end"]
    for name in start:
        print(f"RSS {name}: step 1 {start[name] / 2**20:.0f} MB -> step {steps} {end[name] / 2**20:.0f} MB")
    for name in set(start) & set(end):
        assert end[name] - start[name] < 150 * 2**20, f"{name} grew from {start[name]} to {end[name]} bytes"
    # The store keeps a few versions of a ~1.6 MB model, never one per step.
    assert summary["shm_bytes"] < 20 * 2**20
    e = summary["episodes"]
    # Rollouts reserve room in the buffer only for batches that can still train them, none past the last step.
    assert e["held_in_buffer"] <= 32, e
    # Generated with the newest version, within the bound and trained oldest first: next to nothing ages out (the
    # earlier scheme, max_policy_age + 1 batches ahead on any version, dropped ~29% in the tiny default).
    assert e["dropped_too_old"] <= 0.01 * e["generated"], e
    assert e["generated"] == e["trained"] + e["held_in_buffer"] + e["dropped_too_old"] + e["dropped_buffer_full"] + \
        e["dropped_zero_variance"]


def test_synchronous_grpo_on_the_vllm_engine_trains_on_policy_and_the_reference_model_scores_its_tokens(tmp_path):
    # One app start for the vLLM engine and for synchronous mode (each an app start of its own before).
    run_dir = tmp_path / "vllm-sync"
    # Room for 4 batches' groups at once: only the replay buffer's reservations keep rollouts to the next batch.
    result = _run_grpo(run_dir, "steps=3", "generator.engine=vllm", "generator.engine_args.enforce_eager=true",
                       "generator.engine_args.max_model_len=64", "replay_buffer.max_policy_age=0",
                       "rollout.concurrency=8", "eval.at_start=false", "checkpoint.final=false",
                       "checkpoint.interval=0", "trainer.minibatches=1", "reference.enabled=true",
                       "trainer.loss_params.kl_coef=0.1", env=marked_environment(str(run_dir)))
    assert "=== GRPO run summary ===" in result.stdout
    rows = _metrics(run_dir)
    assert [int(r["policy_version"]) for r in rows] == [1, 2, 3]
    assert sum(r.get("generator/weight_swaps", 0) for r in rows) >= 1  # vLLM swapped in the trainer's weights
    assert all(r["train/version_lag"] == 0 for r in rows)  # every token from the version being trained
    # Episodes reach the reference model packed and its log-probs come back flat, one per completion token. At step
    # 1 (one optimizer step, on policy) the policy is the reference, so their KL is 0 only if every log-prob landed on
    # its own token.
    assert abs(rows[0]["kl"]) < 1e-4, [r["kl"] for r in rows]
    assert all(r["buffer/dropped_too_old"] == 0 for r in rows)
    e = json.loads((run_dir / "summary.json").read_text())["episodes"]
    # Nothing generated for a version that is stale on arrival, nothing generated past the last step.
    assert e["dropped_too_old"] == e["dropped_buffer_full"] == e["held_in_buffer"] == 0, e
    assert e["generated"] == e["trained"] == 3 * 32, e
    assert not processes_with_mark(str(run_dir))  # vLLM's engine-core process included


def test_a_killed_controller_leaves_nothing_and_resume_skips_a_corrupt_checkpoint_and_continues(tmp_path):
    run_dir = tmp_path / "resume"
    command = _grpo_command(run_dir, "steps=8", "checkpoint.interval=2", "eval.at_start=false", "eval.at_end=false")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=marked_environment(str(run_dir)))
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "checkpoints" / "step_000004" / "job_state.pkl").exists():
            assert proc.poll() is None, "the run ended before its second checkpoint"
            assert time.monotonic() < deadline
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not processes_with_mark(str(run_dir)), "processes outlived a killed controller"

    # A truncated newest checkpoint is refused by name, before the job starts any process; the one before it resumes.
    newest, previous = sorted((run_dir / "checkpoints").glob("step_*[0-9]"), reverse=True)[:2]
    state = newest / "job_state.pkl"
    state.write_bytes(state.read_bytes()[:20])
    refused = subprocess.run(command + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0
    assert f"checkpoint {newest} is corrupt or incomplete" in refused.stderr and previous.name in refused.stderr
    assert "provisioned mesh" not in refused.stdout
    newest.rename(newest.with_name(newest.name + ".corrupt"))
    checkpointed = int(previous.name.split("_")[1])
    rows_before = len(_metrics(run_dir))

    result = subprocess.run(command + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {previous}: step {checkpointed}, policy version {checkpointed}" in result.stdout
    resumed = _metrics(run_dir)[rows_before:]
    # Step and policy version continue from the checkpoint: no step repeated from 1, none skipped.
    assert [r["step"] for r in resumed] == list(range(checkpointed + 1, 9))
    assert [int(r["policy_version"]) for r in resumed] == list(range(checkpointed + 1, 9))
