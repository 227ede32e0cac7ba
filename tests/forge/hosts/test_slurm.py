"""Jobs whose hosts come from SLURM (`hosts.slurm`, forge/hosts/slurm.py), against a real SLURM on this machine
(tests/slurm_support.py: Debian's slurmctld, slurmd and munge, installed when missing; two nodes, each a simulated
host with its own slurmd, in one partition). A partition SLURM lacks is refused before anything is submitted; a job
queued past its start timeout is cancelled saying why; apps.grpo with its trainer on one node and its generator on
the other finishes through Monarch's SlurmJob and leaves nothing queued or running on either node; SIGTERM, a
SIGKILLed controller and a controller whose machine is gone (its release guard killed too) each release the
allocation within `RELEASE_BOUND_S`; the documented sbatch script (docs/examples/grpo_slurm.sbatch) runs the job with
its controller inside the allocation. Skips where network namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.multihost_support import namespaces_unavailable, relaunch_as_controller_host
from tests.slurm_support import KILL_WAIT_S, PARTITION, SlurmCluster

from forge.hosts import slurm
from forge.hosts.config import HostsError, SlurmConfig

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

_UNAVAILABLE = namespaces_unavailable()
if _UNAVAILABLE is None:
    relaunch_as_controller_host()  # at collection, before any test ran: slurmctld needs this host's name

ROOT = Path(__file__).resolve().parents[3]
PORT = 26600  # each node's Monarch worker (hosts.port)
# A killed controller's allocation: cancelled by its release guard within GUARD_POLL_S, out of the queue once SLURM
# has ended its processes (SIGTERM, SIGKILL after KillWait: 10 s in this cluster, 30 s by default): docs/hosts.md.
RELEASE_BOUND_S = 30.0
# A job stopped by SIGTERM releases its allocation as the last step of its shutdown: forge.lifecycle's stop grace and
# exit deadline (25 s each) bound it, plus the release bound.
STOP_BOUND_S = 50.0 + RELEASE_BOUND_S


@pytest.fixture(scope="module")
def cluster():
    if _UNAVAILABLE is not None:
        pytest.skip(_UNAVAILABLE)
    started = SlurmCluster(count=2)
    try:
        started.start()
        yield started
    finally:
        started.close()


@pytest.fixture(autouse=True)
def _nothing_queued_after(request):
    """A test that failed leaves no job for the next one (the cluster has two nodes)."""
    yield
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        cluster.run("scancel", f"--partition={PARTITION}", check=False)
        _until(lambda: not cluster.jobs(), 60, "the queue empty after the test")


def _until(ok, timeout_s: float, what: str) -> float:
    """Seconds until `ok()`; fails naming `what` past `timeout_s`."""
    started = time.monotonic()
    while not ok():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.25)
    return time.monotonic() - started


def _left(cluster: SlurmCluster) -> dict:
    """What a job left: jobs in squeue, and each node's processes (but slurmd) and /dev/shm entries."""
    return {"queue": cluster.jobs(),
            **{node.name: ([p.pid for p in cluster.job_processes(node)], node.shared_memory()) for node in cluster.nodes}}


def _nothing_left(cluster: SlurmCluster) -> bool:
    return not cluster.jobs() and all(not cluster.job_processes(n) and not n.shared_memory() for n in cluster.nodes)


def _worker_logs(folder: Path) -> str:
    return "".join(f"\n--- {p.name}:\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(folder.glob("slurm_*")))


def test_an_unknown_partition_or_more_nodes_than_it_has_is_refused_before_anything_is_submitted(cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    with pytest.raises(HostsError) as refused:
        slurm.check_slurm(SlurmConfig(nodes=2, partition="gpu"))
    assert str(refused.value) == f"hosts.slurm.partition='gpu': SLURM has no such partition (it has: {PARTITION})"
    with pytest.raises(HostsError) as refused:
        slurm.check_slurm(SlurmConfig(nodes=3))  # the default partition
    assert str(refused.value) == f"hosts.slurm.nodes=3: partition '{PARTITION}' has 2 node(s)"
    slurm.check_slurm(SlurmConfig(nodes=2, partition=PARTITION))
    assert cluster.jobs() == []


def _grpo(cluster: SlurmCluster, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """apps.grpo with `hosts.slurm`: two nodes, the trainer on node 0, the generator on node 1 (the tiny two-host run
    of tests/forge/test_multihost.py)."""
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", *_TINY, f"run_dir={run_dir}",
               "hosts.slurm.nodes=2", f"hosts.slurm.partition={PARTITION}", f"hosts.slurm.log_dir={run_dir / 'slurm'}",
               f"hosts.port={PORT}", "hosts.roles={trainer: [0], generator: [1]}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, cwd=ROOT, env=cluster.env, stdout=(run_dir / "stdout.log").open("w"),
                            stderr=(run_dir / "stderr.log").open("w"), start_new_session=True)


_TINY = ["warm_start.enabled=false", "eval.at_start=false", "eval.num_prompts=32", "checkpoint.final=false",
         "rollout.concurrency=2", "replay_buffer.batch_size=32", "trainer.micro_batch_size=32"]


def test_a_job_queued_past_its_start_timeout_is_cancelled_and_the_error_says_why(cluster, tmp_path):
    blocker = cluster.run("sbatch", "--parsable", "--nodes=2", "--exclusive", f"--output={tmp_path / 'blocker.out'}",
                          "--wrap", "sleep 600").stdout.strip()
    _until(lambda: any(line.startswith(f"{blocker} RUNNING") for line in cluster.jobs()), 30, "the blocker running")
    app = _grpo(cluster, tmp_path / "grpo", "hosts.slurm.start_timeout_s=4")
    try:
        assert app.wait(timeout=180) == 2
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
    stderr = (tmp_path / "grpo" / "stderr.log").read_text()
    assert "config error: hosts.slurm.start_timeout_s=4: job " in stderr, stderr[-3000:]
    assert "was still PENDING after 4 s (SLURM's reason: Resources); it was cancelled" in stderr, stderr[-3000:]
    assert [line.split()[0] for line in cluster.jobs()] == [blocker]  # the timed-out job is gone, the blocker runs


def _small_job(cluster: SlurmCluster, folder: Path) -> subprocess.Popen:
    """tests.multihost_support's small job through `hosts.slurm`: version 1 published on node 0, relayed to node 1."""
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "tests.multihost_support", "slurm", str(PORT), str(folder / "slurm"),
                             PARTITION], cwd=ROOT, env=cluster.env, stdout=(folder / "stdout.log").open("w"),
                            stderr=(folder / "stderr.log").open("w"), start_new_session=True)


def _wait_until_ready(cluster: SlurmCluster, job: subprocess.Popen, folder: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while "ready: version 1 on both hosts" not in (folder / "stdout.log").read_text():
        assert job.poll() is None, (f"the job exited with {job.returncode}:\n{(folder / 'stderr.log').read_text()[-3000:]}"
                                    + _worker_logs(folder / "slurm"))
        assert time.monotonic() < deadline, f"the job was not ready in {timeout} s"
        time.sleep(0.5)
    assert len(cluster.jobs()) == 1 and " RUNNING " in cluster.jobs()[0]
    assert all(cluster.job_processes(node) and node.shared_memory() for node in cluster.nodes)  # version 1 on both


def _release_guard(job: subprocess.Popen) -> psutil.Process:
    guards = [p for p in psutil.Process(job.pid).children() if any("scancel" in part for part in p.cmdline())]
    assert len(guards) == 1, guards
    return guards[0]


def test_sigterm_mid_run_releases_the_allocation(cluster, tmp_path):
    job = _small_job(cluster, tmp_path)
    try:
        _wait_until_ready(cluster, job, tmp_path)
        os.kill(job.pid, signal.SIGTERM)
        stopped = time.monotonic()
        assert job.wait(timeout=STOP_BOUND_S) == 128 + signal.SIGTERM
        took = _until(lambda: _nothing_left(cluster), STOP_BOUND_S, f"released after SIGTERM: {_left(cluster)}")
        print(f"SIGTERM: controller exited after {time.monotonic() - stopped - took:.1f} s, nothing left after "
              f"{time.monotonic() - stopped:.1f} s")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_a_sigkilled_controller_releases_the_allocation_within_the_bound(cluster, tmp_path):
    job = _small_job(cluster, tmp_path)
    try:
        _wait_until_ready(cluster, job, tmp_path)
        os.kill(job.pid, signal.SIGKILL)
        took = _until(lambda: not cluster.jobs(), RELEASE_BOUND_S, f"out of the queue: {_left(cluster)}")
        rest = _until(lambda: _nothing_left(cluster), RELEASE_BOUND_S, f"nothing left: {_left(cluster)}")
        print(f"SIGKILL: out of squeue {took:.1f} s after, nothing on the nodes {took + rest:.1f} s after")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_a_controller_gone_with_its_release_guard_still_releases_the_allocation_through_the_lifeline(
        cluster, tmp_path):
    """As when the controller's machine vanishes: no scancel comes; each node's watch process sees its lifeline
    close and ends the node's worker (forge.compat 52), which ends the job."""
    job = _small_job(cluster, tmp_path)
    try:
        _wait_until_ready(cluster, job, tmp_path)
        guard = _release_guard(job)
        guard.kill()  # a zombie until the controller reaps it (never: it is SIGKILLed next); it can act no more
        _until(lambda: not guard.is_running() or guard.status() == psutil.STATUS_ZOMBIE, 10, "the guard killed")
        os.kill(job.pid, signal.SIGKILL)
        took = _until(lambda: _nothing_left(cluster), RELEASE_BOUND_S, f"nothing left: {_left(cluster)}")
        print(f"SIGKILL with the guard: nothing left {took:.1f} s after (KillWait {KILL_WAIT_S} s)")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_grpo_through_hosts_slurm_with_the_trainer_and_generator_on_two_nodes_finishes_and_leaves_nothing(
        cluster, tmp_path):
    run_dir = tmp_path / "grpo"
    app = _grpo(cluster, run_dir, "steps=3")
    try:
        assert app.wait(timeout=480) == 0, (run_dir / "stderr.log").read_text()[-3000:] + _worker_logs(run_dir / "slurm")
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
    stderr = (run_dir / "stderr.log").read_text()
    assert f"hosts.slurm: job " in stderr and cluster.nodes[0].name in stderr, stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["policy_version"]) for r in rows] == [1, 2, 3]
    # The generator on node 1 took versions relayed from the trainer's node: relays and the job secret work there.
    assert sum(r.get("generator/weight_swaps", 0) for r in rows) >= 1
    assert sum(r.get("relay/bytes", 0) for r in rows) > 0
    e = json.loads((run_dir / "summary.json").read_text())["episodes"]
    assert e["generated"] > 0 and e["trained"] > 0
    assert e["generated"] == e["trained"] + e["held_in_buffer"] + e["dropped_too_old"] + e["dropped_buffer_full"] + \
        e["dropped_zero_variance"]
    _until(lambda: _nothing_left(cluster), RELEASE_BOUND_S, f"nothing left after the job: {_left(cluster)}")


def test_the_documented_sbatch_script_runs_grpo_with_its_controller_inside_the_allocation(cluster, tmp_path):
    run_dir = tmp_path / "grpo"
    out = tmp_path / "slurm.out"
    job_id = cluster.run("sbatch", "--parsable", f"--partition={PARTITION}", f"--output={out}", f"--chdir={ROOT}",
                         str(ROOT / "docs/examples/grpo_slurm.sbatch"), *_TINY, "steps=2", f"run_dir={run_dir}",
                         f"hosts.slurm.log_dir={tmp_path / 'slurm'}", f"hosts.port={PORT}").stdout.strip()
    try:
        _until(lambda: not cluster.jobs(), 480, f"job {job_id} (the sbatch script) done")
    except AssertionError:
        raise AssertionError(out.read_text()[-3000:] if out.exists() else "no output") from None
    text = out.read_text()
    assert (run_dir / "summary.json").exists(), text[-3000:] + _worker_logs(tmp_path / "slurm")
    assert f"hosts.slurm: workers on ['{cluster.nodes[0].name}', '{cluster.nodes[1].name}'] of allocation {job_id}" \
        in text, text[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["policy_version"]) for r in rows] == [1, 2]
    assert sum(r.get("relay/bytes", 0) for r in rows) > 0
    e = json.loads((run_dir / "summary.json").read_text())["episodes"]
    assert e["generated"] == e["trained"] + e["held_in_buffer"] + e["dropped_too_old"] + e["dropped_buffer_full"] + \
        e["dropped_zero_variance"]
    state = cluster.run("scontrol", "show", "job", job_id, check=False).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
    _until(lambda: _nothing_left(cluster), RELEASE_BOUND_S, f"nothing left after the script: {_left(cluster)}")
