"""Faults injected into a running `python -m apps.grpo`: what survives, what stops fast, and what is left behind."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import WatchedProcess, marked_environment, processes_with_mark
from forge.weights.store import SHM_DIR

pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
# A role's mesh is `<role>-<n>`, a service replica's `<role>-r<replica>-<n>` (replicas start together, so their lines
# come in any order).
PIDS = re.compile(r"provisioned mesh ([a-z_]+(?:-r\d+)?)-\d+: \d+ procs \(pids \[([\d, ]+)\]\)")


def _command(run_dir: Path, *overrides: str, config: str = "configs/grpo_tiny.yaml") -> list[str]:
    return [sys.executable, "-m", "apps.grpo", "--config", config, f"run_dir={run_dir}",
            "warm_start.enabled=false", "eval.at_start=false", "eval.at_end=false", "rollout.concurrency=2",
            "replay_buffer.batch_size=32", "trainer.micro_batch_size=32", *overrides]


# An OpenEnv environment whose synchronous step sleeps 1000 s on every `block_every`-th step of its process and in the
# episodes of `block_seeds` (tests/rl/environments/openenv_sleepy.py), trained as a user's YAML would name it.
SLEEPY = ["task.source=openenv", "task.name=tests.rl.environments.openenv_sleepy:SleepyEnvironment",
          "task.held_out=16", "eval.num_prompts=16", "rollout.group_size=8", "rollout.max_tokens=1",
          "rollout.drop_zero_variance_groups=false", "rollout.max_dropped_groups_per_step=null",
          "trainer.minibatches=1", "checkpoint.interval=0", "environment.step_timeout_s=1"]


class RunningJob(WatchedProcess):
    """The app as a subprocess with its output in a file, so a test can watch it while it runs."""

    def __init__(self, run_dir: Path, *overrides: str, config: str = "configs/grpo_tiny.yaml") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        super().__init__(_command(run_dir, *overrides, config=config), run_dir.parent / f"{run_dir.name}.log", ROOT,
                         env=marked_environment(str(run_dir)))

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def pids(self, mesh: str) -> list[int]:
        """The pids of role `mesh` ("trainer") or of one replica of a service ("generator-r0")."""
        found = [m.group(2) for m in PIDS.finditer(self.output()) if m.group(1) == mesh]
        assert found, f"no mesh {mesh!r} in the output"
        return [int(p) for p in found[0].split(",")]


def _job_segments(pid: int) -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"forge-{pid}-*")]


def _assert_stopped_by_signal_within_30s(job: RunningJob, sig: signal.Signals) -> dict:
    """Send `sig`; the job ends within 30 s with 128 + sig, a summary, the final checkpoint at the step it stopped
    at, and no process or shared-memory segment left. Returns the summary."""
    job.proc.send_signal(sig)
    sent_at = time.monotonic()
    code = job.finish(timeout=60)
    assert time.monotonic() - sent_at < 30
    assert code == 128 + sig.value, job.output()[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["interrupted"] == sig.name
    saved = job.run_dir / "checkpoints" / f"step_{summary['steps']:06d}"
    assert (saved / "job_state.pkl").exists()  # the final checkpoint is the step the job stopped at
    assert not processes_with_mark(str(job.run_dir), timeout=5)
    assert not _job_segments(job.proc.pid)
    return summary


def test_generator_replica_killed_mid_run_is_restarted_and_sigterm_then_stops_it_cleanly(tmp_path):
    # The run is stopped once the restarted replica has been in service for a few steps: a fixed step count long
    # enough for the restart on a loaded 2-core CI machine cost 3 minutes. SIGTERM's clean stop is checked on this
    # run rather than on a job of its own (SIGINT's test below): one app start less in the suite.
    job = RunningJob(tmp_path / "run", "steps=100000", "resources.generator_replicas=2", "checkpoint.interval=0")
    job.wait_for(lambda: job.steps_logged() >= 2, "step 2")
    victim = job.pids("generator-r0")[0]
    subprocess.run(["kill", "-9", str(victim)], check=True)
    job.wait_for(lambda: "replica 0 restarted" in job.output(), "replica 0 restarted")
    restarted_at = job.steps_logged()
    job.wait_for(lambda: job.steps_logged() >= restarted_at + 3, "3 steps after the restart")
    summary = _assert_stopped_by_signal_within_30s(job, signal.SIGTERM)
    out = job.output()
    assert "replica 0 failed" in out and f"process {victim} of mesh 'generator-r0" in out
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))  # no step lost or repeated


def test_trainer_death_stops_the_job_within_30s_naming_it(tmp_path):
    # Resuming after a failure (a corrupt newest checkpoint skipped) is tests/apps/grpo/test_main.py's, after a SIGKILL.
    job = RunningJob(tmp_path / "run", "steps=40", "checkpoint.interval=2")
    job.wait_for(lambda: (job.run_dir / "checkpoints" / "step_000002" / "job_state.pkl").exists(), "a checkpoint")
    (trainer,) = job.pids("trainer")
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(trainer)], check=True)
    code = job.finish(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert code == 1  # forge.lifecycle: a dead actor mesh ends the job with 1
    out = job.output()
    assert "FATAL: actor mesh 'trainer-" in out and f"process {trainer} of mesh 'trainer-" in out
    assert not processes_with_mark(str(job.run_dir), timeout=5)
    assert not _job_segments(job.proc.pid)


def test_a_reward_that_raises_hangs_or_returns_nan_is_scored_as_failure_and_sigint_then_stops_cleanly(tmp_path):
    # SIGINT's clean stop is checked on this run rather than on a job of its own (as SIGTERM's is above).
    job = RunningJob(tmp_path / "run", "steps=200", "task.reward=tests.support:faulty_reward",
                     "task.reward_timeout_s=0.2")
    job.wait_for(lambda: job.steps_logged() >= 2, "step 2")  # trained on past the failed rewards
    summary = _assert_stopped_by_signal_within_30s(job, signal.SIGINT)
    assert 2 <= summary["steps"] < 200 and summary["reward_failures"] > 0
    out = job.output()
    for kind in ("RuntimeError", "TimeoutError", "ValueError"):  # raised, hung, NaN: each shown once
        assert out.count(f"reward function failed ({kind})") == 1, kind


def test_an_isolated_environment_whose_step_blocks_costs_its_episodes_and_the_run_finishes(tmp_path):
    # The in-process case is tests/apps/grpo/test_environment_failures.py's (the job's rollouts, no app start).
    job = RunningJob(tmp_path / "run", *SLEEPY, "task.options={sleep_s: 1000, block_every: 40, block_seeds: [0, 1]}",
                     "steps=3", "eval.at_end=true", "checkpoint.final=false", "environment.isolated=true",
                     config="configs/multiturn_tiny.yaml")
    assert job.finish() == 0, job.output()[-3000:]
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    e = summary["episodes"]
    assert e["trained"] == 3 * 32 and e["dropped_environment_failure"] > 0, e
    # Failed episodes are dropped, with the rest of their group where fewer than 2 were left.
    assert 0 < summary["environment_failures"] <= e["dropped_environment_failure"]
    assert e["generated"] == e["trained"] + e["held_in_buffer"] + e["dropped_too_old"] + e["dropped_buffer_full"] + \
        e["dropped_zero_variance"] + e["dropped_environment_failure"]
    out = job.output()
    assert f"environment failure {e['dropped_environment_failure']})" in out  # the summary's text says so too
    # Its rewards are partial (1 or 0.5): the held-out score is a mean reward, without the failed episodes.
    # (the evaluator's rules, apps/held_out/: counted with their error, EnvironmentFailed: what the episode ended with)
    assert "held-out greedy mean reward" in out and "more left out, failed: EnvironmentFailed: " in out, out[-3000:]
    assert summary["held_out_score"] == "mean reward"
    assert not processes_with_mark(str(job.run_dir), timeout=5)


def test_sigterm_ends_a_job_with_a_blocked_environment_within_30s_with_its_summary(tmp_path):
    job = RunningJob(tmp_path / "run", *SLEEPY, "task.options={sleep_s: 1000, block_every: 20}", "steps=200",
                     config="configs/multiturn_tiny.yaml")
    job.wait_for(lambda: job.steps_logged() >= 1, "step 1")
    summary = _assert_stopped_by_signal_within_30s(job, signal.SIGTERM)
    assert "=== GRPO run summary ===" in job.output()
    assert summary["steps"] >= 1 and summary["episodes"]["dropped_environment_failure"] > 0
