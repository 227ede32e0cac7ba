"""The hosts of a job from SLURM (`hosts.slurm`, forge.hosts.config.SlurmConfig): what can be checked before anything
is submitted, the queue as `squeue --json` reports it, and the release of the allocation however the controller ends.
No Monarch here (forge.hosts.host_mesh holds the Monarch side: `monarch.job.SlurmJob`, the attach).

Two forms (docs/hosts.md, "On a SLURM cluster"):
- submitted: the controller runs where the user starts it (a login node); Monarch's `SlurmJob` submits one worker
  per node with sbatch (`python -m forge.hosts.slurm_worker`, srun inside), forge waits until the job runs (at
  most `start_timeout_s`, then cancels it, saying why it waited), attaches, and releases it with scancel at the end;
- in the allocation (`in_allocation: true`): a user's own sbatch script runs the controller on the allocation's
  first node; forge starts the workers with srun on the allocation's nodes, as Monarch's batch mode does, and the
  allocation ends with the script.

Release (the bound docs/hosts.md states and tests/forge/hosts/test_slurm.py checks): a job that ends in any way
(success, failure, SIGINT/SIGTERM) cancels its allocation as its last step; a controller that dies without that
(SIGKILL, a crash) is noticed by its release guard, a detached process started before the job is submitted, which
cancels the job within `GUARD_POLL_S` of the death. The job then leaves the queue once its processes are gone:
SLURM sends them SIGTERM, and SIGKILL after the cluster's KillWait (30 s by default). Where the controller's machine
itself vanishes (the guard with it), each node's watch process sees its lifeline to the controller close (forge.compat
22) and ends the node's worker, which ends the job; the job's time limit (`time`) is the last bound.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

from forge.hosts.config import HostsError, SlurmConfig

SLURM_JOB_VARIABLE = "FORGE_SLURM_JOB"  # in a worker's environment: its node belongs to this job's allocation
GUARD_POLL_S = 0.5  # the release guard looks at the controller this often
COMMAND_TIMEOUT_S = 30.0  # any one SLURM command (sbatch, squeue, sinfo, scancel)
POLL_S = 1.0  # how often a queued job's state is read
TERMINAL_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "COMPLETED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE")


def _tools(cfg: SlurmConfig) -> tuple[str, ...]:
    return ("srun", "squeue") if cfg.in_allocation else ("sbatch", "squeue", "scancel", "sinfo")


def run_command(*command: str, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """A SLURM command, bounded; a command that cannot run or times out raises HostsError naming it."""
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except OSError as e:
        raise HostsError(f"hosts.slurm: cannot run {command[0]} ({e})") from None
    except subprocess.TimeoutExpired:
        raise HostsError(f"hosts.slurm: `{' '.join(command)}` did not answer within {timeout:.0f} s: is slurmctld "
                         "up?") from None


def check_slurm(cfg: SlurmConfig, path: str = "hosts.slurm") -> None:
    """Everything that can be refused before a job is submitted, each naming the field: SLURM's commands on PATH,
    the partition, enough nodes in it (or in the allocation this controller runs in)."""
    missing = [tool for tool in _tools(cfg) if shutil.which(tool) is None]
    if missing:
        raise HostsError(f"{path}.nodes={cfg.nodes}: SLURM's {', '.join(missing)} not on PATH; run the controller "
                         "where SLURM's client commands are (a login node), or use hosts.addresses with "
                         "hand-started agents")
    if cfg.in_allocation:
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            raise HostsError(f"{path}.in_allocation=true: this process runs in no SLURM allocation (SLURM_JOB_ID is "
                             "unset); run it from an sbatch script, or set in_allocation=false to submit a job")
        have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
        if have and cfg.nodes > have:
            raise HostsError(f"{path}.nodes={cfg.nodes}: the allocation this controller runs in (job {job}) has "
                             f"{have} node(s); ask sbatch for --nodes={cfg.nodes}")
        return
    listed = run_command("sinfo", "-h", "-o", "%P %D")
    if listed.returncode != 0:
        raise HostsError(f"{path}: `sinfo` failed, so SLURM cannot take the job: {listed.stderr.strip()[-500:]}")
    nodes: dict[str, int] = {}
    default = None
    for line in listed.stdout.splitlines():
        if len(line.split()) != 2:
            continue
        name, count = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        nodes[name] = nodes.get(name, 0) + int(count)
    partition = cfg.partition or default
    if cfg.partition is not None and cfg.partition not in nodes:
        raise HostsError(f"{path}.partition={cfg.partition!r}: SLURM has no such partition (it has: "
                         f"{', '.join(sorted(nodes)) or 'none'})")
    if partition is not None and cfg.nodes > nodes.get(partition, 0):
        raise HostsError(f"{path}.nodes={cfg.nodes}: partition {partition!r} has {nodes.get(partition, 0)} node(s)")


# -- the queue --------------------------------------------------------------------------------------------------


def job_info(job_id: str) -> dict[str, Any] | None:
    """The job as `squeue --json` reports it, or None once SLURM no longer lists it."""
    result = run_command("squeue", "--job", job_id, "--json")
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return None
        raise HostsError(f"hosts.slurm: `squeue --job {job_id} --json` failed: {result.stderr.strip()[-500:]}")
    try:
        jobs = json.loads(result.stdout or "{}").get("jobs", [])
    except json.JSONDecodeError as e:
        raise HostsError(f"hosts.slurm: `squeue --json` answered no JSON ({e}); SLURM needs its serializer/json "
                         "plugin") from None
    # SLURM 22.05's squeue --json lists every job whatever --job names (forge.compat 50): pick ours by its id.
    return next((job for job in jobs if str(job.get("job_id")) == str(job_id)), None)


def job_state(info: dict[str, Any]) -> str:
    """SLURM 22.05 gives the state as a string, later releases as a list of flags."""
    state = info.get("job_state", "")
    return " ".join(state) if isinstance(state, list) else str(state)


def node_names(info: dict[str, Any]) -> list[str]:
    """The allocated nodes' names, in the allocation's order, from either layout of `job_resources` (forge.compat,
    50: SLURM 22.05 lists `allocated_nodes[].nodename`, later releases `nodes.allocation[].name`)."""
    resources = info.get("job_resources") or {}
    nodes = resources.get("nodes")
    if isinstance(nodes, dict) and nodes.get("allocation"):
        return [node["name"] for node in nodes["allocation"]]
    return [node["nodename"] for node in resources.get("allocated_nodes") or []]


def wait_until_running(job_id: str, nodes: int, timeout_s: float, log_hint: str,
                       deadline: float | None = None) -> list[str]:
    """The job's node names once it runs. A job still queued after `timeout_s` (from the submission: `deadline`,
    a time.monotonic() value, when given) is cancelled and the error says why it waited (SLURM's reason); a job that
    ends or vanishes first raises naming its state."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    reason = ""
    while True:
        info = job_info(job_id)
        if info is None:
            raise HostsError(f"hosts.slurm: job {job_id} left the queue before it ran ({log_hint})")
        state = job_state(info)
        if "RUNNING" in state:
            names = node_names(info)
            if len(names) != nodes:
                cancel(job_id)
                raise HostsError(f"hosts.slurm.nodes={nodes}: job {job_id} runs on {len(names)} node(s) {names}; "
                                 "it was cancelled")
            return names
        if any(s in state for s in TERMINAL_STATES):
            raise HostsError(f"hosts.slurm: job {job_id} ended before it ran: {state} "
                             f"({info.get('state_reason', '')}; {log_hint})")
        if info.get("state_reason") not in (None, "", "None"):  # "None": not yet looked at by the scheduler
            reason = info["state_reason"]
        if time.monotonic() > deadline:
            cancel(job_id)
            raise HostsError(f"hosts.slurm.start_timeout_s={timeout_s:g}: job {job_id} was still {state or 'queued'} "
                             f"after {timeout_s:g} s (SLURM's reason: {reason or 'none given'}); it was cancelled")
        time.sleep(POLL_S)


def cancel(job_id: str) -> bool:
    """scancel the job; True when SLURM took the request (a job that already ended is not an error)."""
    result = run_command("scancel", job_id)
    return result.returncode == 0


def is_active(job_id: str) -> bool:
    info = job_info(job_id)
    return info is not None and not any(s in job_state(info) for s in TERMINAL_STATES)


def allocation_node_names(nodes: int) -> list[str]:
    """The first `nodes` nodes of the allocation this process runs in ($SLURM_JOB_ID), as squeue lists them."""
    job = os.environ["SLURM_JOB_ID"]
    info = job_info(job)
    names = node_names(info) if info is not None else []
    if len(names) < nodes:
        raise HostsError(f"hosts.slurm.nodes={nodes}: squeue lists {len(names)} node(s) for this allocation "
                         f"(job {job}): {names}")
    return names[:nodes]


def resolve(names: list[str]) -> list[str]:
    """Each node's IPv4 address as this controller resolves its name (forge's hosts are known by address)."""
    addresses = []
    for name in names:
        try:
            addresses.append(socket.gethostbyname(name))
        except OSError as e:
            raise HostsError(f"hosts.slurm: node {name!r} of the allocation does not resolve here ({e}): the "
                             "controller must reach the nodes by name") from None
    return addresses


def wait_for_workers(names: list[str], addresses: list[str], port: int, deadline: float, alive, log_hint: str) -> None:
    """Until every node's worker accepts connections on `port`; `alive()` False (the job or srun ended) or the
    deadline raises naming the nodes that never answered."""
    waiting = dict(zip(names, addresses))
    while waiting:
        for name, address in list(waiting.items()):
            try:
                with socket.create_connection((address, port), timeout=1):
                    del waiting[name]
            except OSError:
                pass
        if not waiting:
            return
        if not alive() or time.monotonic() > deadline:
            why = "the job ended" if not alive() else "not within hosts.slurm.start_timeout_s"
            raise HostsError(f"hosts.slurm: the worker on node(s) {sorted(waiting)} never listened on port {port} "
                             f"({why}; {log_hint})")
        time.sleep(0.3)


# -- the release guard -------------------------------------------------------------------------------------------

# Runs detached from the controller (its own session): reads job ids on stdin; once the controller is gone (its pid,
# checked with its start time, or the pipe's end: the controller held the only writer), cancels every job it was told
# of and any job of the user with the controller's job name. Imports nothing of forge.
_GUARD = """
import os, select, subprocess, sys, time
import psutil
controller, name, user, poll = psutil.Process(int(sys.argv[1])), sys.argv[2], sys.argv[3], float(sys.argv[4])
jobs, closed = [], False
while not closed:
    try:
        if not controller.is_running() or controller.status() == psutil.STATUS_ZOMBIE:
            break
    except psutil.Error:
        break
    ready, _, _ = select.select([sys.stdin], [], [], poll)
    if ready:
        line = sys.stdin.readline()
        if line:
            jobs.append(line.strip())
        else:
            closed = True
for command in ([["scancel", job] for job in jobs if job] + [["scancel", "--user", user, "--name", name]]):
    try:
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except Exception:
        pass
"""


class ReleaseGuard:
    """The detached process that cancels this controller's SLURM job once the controller is gone, however it went
    (a SIGKILL included). Started before the job is submitted, so no moment exists where a job has no guard."""

    def __init__(self, job_name: str) -> None:
        self.job_name = job_name
        self.process = subprocess.Popen(
            [sys.executable, "-c", _GUARD, str(os.getpid()), job_name, getpass.getuser(), str(GUARD_POLL_S)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            text=True)

    def watch(self, job_id: str) -> None:
        """Cancel `job_id` too once the controller is gone."""
        if self.process.stdin is not None:
            self.process.stdin.write(job_id + "\n")
            self.process.stdin.flush()
