"""`hosts.slurm` refused before anything is submitted (forge/hosts/config.py, forge/hosts/slurm.py), and the queue
as SLURM's `squeue --json` reports it in both its layouts. No SLURM needed: tests/forge/hosts/test_slurm.py runs the
jobs against a real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from forge.hosts import slurm
from forge.hosts.config import HostsConfig, HostsError, SlurmConfig

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)


def _slurm(**kwargs) -> SlurmConfig:
    return SlurmConfig(**{"nodes": 2, **kwargs})


@pytest.mark.parametrize("section, message", [
    (HostsConfig(slurm=_slurm(), roles={"trainer": [0], "generator": [2]}),
     "hosts.roles.generator: node index 2 is out of range: hosts.slurm.nodes=2 (indices 0..1)"),
    (HostsConfig(slurm=_slurm(nodes=1), roles={"trainer": [0], "generator": [1]}),
     "hosts.roles.generator: node index 1 is out of range: hosts.slurm.nodes=1"),
    (HostsConfig(slurm=_slurm(nodes=-1)), "hosts.slurm.nodes=-1: must be >= 1"),
    (HostsConfig(slurm=_slurm(time="soon")), "hosts.slurm.time='soon': not a SLURM time"),
    (HostsConfig(slurm=_slurm(start_timeout_s=0)), "hosts.slurm.start_timeout_s=0: must be > 0"),
    (HostsConfig(slurm=_slurm(gpus_per_node=-1)), "hosts.slurm.gpus_per_node=-1: must be >= 0"),
    (HostsConfig(slurm=_slurm(partition="a b")), "hosts.slurm.partition='a b': must be a SLURM name"),
    (HostsConfig(slurm=_slurm(sbatch_args=["constraint=h100"])), "hosts.slurm.sbatch_args[0]='constraint=h100'"),
    (HostsConfig(slurm=_slurm(sbatch_args=["--exclusive", "--nodes=4"])),
     "hosts.slurm.sbatch_args[1]='--nodes=4': forge sets --nodes itself"),
    (HostsConfig(addresses=["198.18.0.2"], slurm=_slurm()), "hosts.slurm.nodes=2 and hosts.addresses=['198.18.0.2']"),
])
def test_a_bad_slurm_section_is_refused_naming_the_field(section, message):
    with pytest.raises(HostsError) as refused:
        section.validate()
    assert message in str(refused.value)


def test_a_good_slurm_section_passes_and_counts_its_nodes_as_hosts():
    section = HostsConfig(slurm=_slurm(time="1-04:00:00", sbatch_args=["--constraint=h100"], gpus_per_node=8),
                          roles={"trainer": [0], "generator": [1]}).validate()
    assert section.enabled and section.count == 2
    assert HostsConfig(slurm=SlurmConfig(time="30")).validate().enabled is False  # nodes 0: no SLURM


def test_no_sbatch_on_path_is_refused_before_anything_is_submitted(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM command there
    with pytest.raises(HostsError) as refused:
        slurm.check_slurm(_slurm())
    assert str(refused.value).startswith("hosts.slurm.nodes=2: SLURM's sbatch, squeue, scancel, sinfo not on PATH")


def test_in_allocation_outside_an_allocation_is_refused(monkeypatch, tmp_path):
    for tool in ("srun", "squeue"):  # present, so that the missing allocation is what is refused
        (tmp_path / tool).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(HostsError, match=r"hosts.slurm.in_allocation=true: this process runs in no SLURM allocation"):
        slurm.check_slurm(_slurm(in_allocation=True))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    with pytest.raises(HostsError, match=r"hosts.slurm.nodes=2: the allocation this controller runs in \(job 7\) has 1"):
        slurm.check_slurm(_slurm(in_allocation=True))


# squeue --json as SLURM 22.05 writes it (Debian 12's slurm-wlm, the layout tests/forge/hosts/test_slurm.py meets),
# and as later releases do (the one Monarch 0.7's SlurmJob reads): forge.compat 50.
SQUEUE_22_05 = {"jobs": [{"job_id": 4, "job_state": "RUNNING", "state_reason": "None", "job_resources": {
    "nodes": "n[0-1]", "allocated_nodes": [{"nodename": "n0", "cpus_used": 2}, {"nodename": "n1", "cpus_used": 2}]}}]}
SQUEUE_LATER = {"jobs": [{"job_id": 4, "job_state": ["RUNNING"], "state_reason": "None", "job_resources": {
    "nodes": {"count": 2, "allocation": [{"name": "n0"}, {"name": "n1"}]}}}]}


@pytest.mark.parametrize("answer", [SQUEUE_22_05, SQUEUE_LATER], ids=["22.05", "later"])
def test_the_allocated_nodes_are_read_from_either_layout_of_squeue_json(answer):
    info = answer["jobs"][0]
    assert slurm.job_state(info) == "RUNNING"
    assert slurm.node_names(info) == ["n0", "n1"]


def _fake_slurm(folder, squeue_answer: dict) -> None:
    """squeue answering `squeue_answer`, scancel writing its arguments to `folder/cancelled`."""
    (folder / "answer.json").write_text(json.dumps(squeue_answer))
    (folder / "squeue").write_text(f"#!/bin/sh\ncat {folder}/answer.json\n")
    (folder / "scancel").write_text(f"#!/bin/sh\necho \"$@\" >> {folder}/cancelled\n")
    for tool in ("squeue", "scancel"):
        (folder / tool).chmod(0o755)


def test_a_job_queued_past_its_start_timeout_is_cancelled_and_the_error_says_why(monkeypatch, tmp_path):
    # As SLURM 22.05 answers `squeue --job 9 --json`: every job in the queue, the running one first (compat 50).
    running = SQUEUE_22_05["jobs"][0]
    pending = {"jobs": [running, {"job_id": 9, "job_state": "PENDING", "state_reason": "Resources",
                                  "job_resources": {}}]}
    _fake_slurm(tmp_path, pending)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "POLL_S", 0.05)
    started = time.monotonic()
    with pytest.raises(HostsError) as refused:
        slurm.wait_until_running("9", 2, 0.5, "logs")
    assert time.monotonic() - started < 5
    assert str(refused.value) == ("hosts.slurm.start_timeout_s=0.5: job 9 was still PENDING after 0.5 s (SLURM's "
                                  "reason: Resources); it was cancelled")
    assert (tmp_path / "cancelled").read_text().split() == ["9"]


def test_the_release_guard_cancels_the_job_once_its_controller_is_killed(tmp_path):
    """The guard outlives a SIGKILLed controller and cancels the job it was told of, and any job of the controller's
    name (the real-SLURM version: tests/forge/hosts/test_slurm.py)."""
    _fake_slurm(tmp_path, {"jobs": []})
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    controller = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from forge.hosts.slurm import ReleaseGuard; "
         "ReleaseGuard('forge-x_1').watch('12'); print('watching', flush=True); time.sleep(60)"],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert controller.stdout.readline().strip() == "watching"
        time.sleep(0.3)
        assert not (tmp_path / "cancelled").exists()  # nothing while the controller lives
        controller.kill()
        killed = time.monotonic()
        while not (tmp_path / "cancelled").exists() or len((tmp_path / "cancelled").read_text().splitlines()) < 2:
            assert time.monotonic() - killed < 10, "the guard did not cancel within 10 s"
            time.sleep(0.1)
        cancelled = (tmp_path / "cancelled").read_text().splitlines()
        assert cancelled[0] == "12" and cancelled[1].endswith("--name forge-x_1")
        assert time.monotonic() - killed < 3
    finally:
        controller.kill()
        controller.wait()
