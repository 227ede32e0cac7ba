"""A Monarch host mesh over the hosts of a `hosts` config section (forge.hosts.config): the controller attaches to
the Monarch worker that every host's agent runs (`python -m forge.hosts.agent`). Everything that can be
refused is refused before the first Monarch call."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import os
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from forge import compat
from forge.endpoints import EndpointActor
from forge import job_auth
from forge.hosts import slurm
from forge.hosts.config import HostsConfig, HostsError, SlurmConfig, worker_address

from monarch.actor import HostMesh, attach_to_workers



def controller_address() -> str:
    """The address the job's other hosts reach this controller at: the first non-loopback address its host
    name resolves to (Monarch listens there: forge.compat, 19)."""
    name = socket.gethostname()
    try:
        resolved = [info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)]
    except OSError as e:
        raise HostsError(f"hosts: this controller's host name {name!r} does not resolve ({e})") from None
    reachable = [a for a in resolved if not ipaddress.ip_address(a).is_loopback]
    if not reachable:
        raise HostsError(f"hosts: this controller's host name {name!r} resolves to {sorted(set(resolved))} only: the "
                         f"job's other hosts could not reach it; map {name!r} to this host's network address in /etc/hosts")
    return reachable[0]


def check_hosts(hosts: HostsConfig) -> None:
    """Check the section (fields, reachable agents or SLURM's commands and partition, this controller's own
    address) and switch this process to tcp (forge.compat, 17); raises HostsError naming the field. Nothing is
    submitted to SLURM here."""
    hosts.validate()
    if not hosts.enabled:
        raise HostsError("hosts: no addresses: a host mesh needs at least one")
    if hosts.slurm.enabled:
        slurm.check_slurm(hosts.slurm)
    else:
        hosts.check_reachable()
    controller_address()  # refuses a host name other hosts could not reach this controller at (19)
    compat.guard_controller_host()  # nothing of the job outlives a SIGKILLed controller here either (22)
    try:
        compat.enable_tcp_transport()
    except RuntimeError as e:
        raise HostsError(f"hosts: configure the hosts before anything else starts Monarch ({e})") from None


def allocate_host_mesh(hosts: HostsConfig, name: str = "hosts") -> HostMesh:
    """The host mesh over `hosts` (checked by `check_hosts`), one dimension `hosts`; returns at once, Monarch
    connects to the hosts' workers in the background. The job's secret is made here; the provisioner passes it to
    each process it spawns on another host (never on a command line, nor through the hosts' agents)."""
    compat.configure_job_environment()
    job_auth.make_job_secret()
    if _allocation is not None and _allocation.addresses == hosts.addresses:
        return _allocation.host_mesh(name)
    return attach_to_workers(ca="trust_all_connections", name=name,
                             workers=[worker_address(address, hosts.port) for address in hosts.addresses])


# -- hosts from SLURM (forge.hosts.slurm) ------------------------------------------------------------------------

_allocation: SlurmAllocation | None = None


class SlurmAllocation:
    """The nodes of a `hosts.slurm` job: submitted through Monarch's `SlurmJob` (sbatch, `squeue --json`, scancel),
    or, in an allocation the controller runs in, workers started with srun; released by `release()`."""

    def __init__(self, hosts: HostsConfig) -> None:
        self.cfg, self.port = hosts.slurm, hosts.port
        self.log_dir = os.path.abspath(self.cfg.log_dir)
        self.job: Any = None  # monarch.job.SlurmJob
        self.workers: subprocess.Popen | None = None  # srun, in an allocation this controller runs in
        self.job_id: str | None = None
        self.names: list[str] = []
        self.addresses: list[str] = []
        self.released = False

    def worker_command(self) -> str:
        """The command line that srun runs on every node, up to the worker's `-c CODE` (forge.compat, 51)."""
        return (f"{shlex.quote(sys.executable)} -m forge.hosts.slurm_worker "
                f"--log-dir {shlex.quote(self.log_dir)}")

    def start(self) -> None:
        """Submit (or, inside an allocation, start the workers), wait until every node's worker listens; bounded by
        `start_timeout_s`, and a job queued past it is cancelled. Raises HostsError, with nothing left queued."""
        os.makedirs(self.log_dir, exist_ok=True)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        if self.cfg.in_allocation:
            self._start_in_allocation()
        else:
            self._submit(deadline)
        self.addresses = slurm.resolve(self.names)
        slurm.wait_for_workers(self.names, self.addresses, self.port, deadline, self._alive, self._log_hint())

    def _log_hint(self) -> str:
        return f"the workers' output: {self.log_dir}/slurm_{self.job_id or '*'}_*"

    def _submit(self, deadline: float) -> None:
        from monarch.job import SlurmJob

        job_name = f"forge-{os.getpid()}-{secrets.token_hex(3)}"
        guard = slurm.ReleaseGuard(f"{job_name}_{os.getpid()}")  # SlurmJob names the job `<job_name>_<pid>`
        self.job = SlurmJob(
            meshes={"hosts": self.cfg.nodes}, python_exe=self.worker_command(), slurm_args=list(self.cfg.sbatch_args),
            monarch_port=self.port, job_name=job_name, time_limit=self.cfg.time, partition=self.cfg.partition,
            log_dir=self.log_dir, gpus_per_node=self.cfg.gpus_per_node, job_start_timeout=int(self.cfg.start_timeout_s),
            account=self.cfg.account, qos=self.cfg.qos)
        # forge.compat 50: SlurmJob takes the first job of `squeue --job ID --json` for its own; SLURM 22.05 lists every
        # job there (a finished one first made SlurmJob.state() refuse ours as "no longer active").
        self.job._get_job_info_json = _job_info_or_none
        try:
            self.job.apply()  # sbatch
        except RuntimeError as e:
            raise HostsError(f"hosts.slurm: sbatch refused the job: {e}") from None
        self.job_id = self.job._slurm_job_id
        guard.watch(self.job_id)
        _say(f"hosts.slurm: job {self.job_id} submitted ({self.cfg.nodes} nodes); the workers' output in "
             f"{self.log_dir}")
        self.names = slurm.wait_until_running(self.job_id, self.cfg.nodes, self.cfg.start_timeout_s, self._log_hint(),
                                              deadline)
        # forge.compat 50: SlurmJob's own wait cannot read SLURM 22.05's squeue --json; it skips it when it has the
        # nodes already.
        self.job._all_hostnames = list(self.names)

    def _start_in_allocation(self) -> None:
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.names = slurm.allocation_node_names(self.cfg.nodes)
        code = ("import os; from monarch.actor import run_worker_loop_forever; run_worker_loop_forever("
                f"address='tcp://' + os.environ['FORGE_HOST_ADDRESS'] + ':{self.port}', ca='trust_all_connections')")
        command = ["srun", f"--nodes={len(self.names)}", f"--ntasks={len(self.names)}", "--ntasks-per-node=1",
                   "--overlap", f"--nodelist={','.join(self.names)}", *shlex.split(self.worker_command()), "-c", code]
        out = open(os.path.join(self.log_dir, f"slurm_{self.job_id}_workers.out"), "ab")
        self.workers = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()
        _say(f"hosts.slurm: workers on {self.names} of allocation {self.job_id} (srun, pid {self.workers.pid}); "
             f"their output in {out.name}")

    def _alive(self) -> bool:
        if self.workers is not None:
            return self.workers.poll() is None
        return slurm.is_active(self.job_id)

    def host_mesh(self, name: str) -> HostMesh:
        """The host mesh over the nodes, one dimension `hosts`, in the allocation's order."""
        if self.job is not None:
            return self.job.state(cached_path=None).hosts  # Monarch's attach; no job cache file in the working folder
        return attach_to_workers(ca="trust_all_connections", name=name,
                                 workers=[worker_address(address, self.port) for address in self.addresses])

    def release(self) -> None:
        """End the allocation (idempotent, bounded): scancel a submitted job still in the queue; in an allocation
        this controller runs in, stop the srun of the workers (the allocation ends with the user's script)."""
        if self.released:
            return
        self.released = True
        if self.workers is not None and self.workers.poll() is None:
            self.workers.terminate()  # srun cancels the step: SIGTERM to every worker
            try:
                self.workers.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.workers.kill()
        if self.job is not None and self.job_id is not None:
            with contextlib.suppress(HostsError):
                if slurm.is_active(self.job_id):
                    self.job.kill()  # Monarch's scancel
                    _say(f"hosts.slurm: job {self.job_id} cancelled")


def _job_info_or_none(job_id: str) -> dict | None:
    """`SlurmJob._get_job_info_json`, picking the job by its id (None where squeue fails, as SlurmJob's own)."""
    try:
        return slurm.job_info(job_id)
    except HostsError:
        return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def allocate_slurm(hosts: HostsConfig) -> HostsConfig:
    """The hosts of a `hosts.slurm` section (checked by `check_hosts`) once SLURM runs the job: the same section with
    the nodes' addresses, in the allocation's order, as a hand-started job lists its agents. The allocation is
    released by `release_slurm` (the provisioner's shutdown), at this process's exit, and by its release guard if
    this process dies (forge.hosts.slurm)."""
    global _allocation
    allocation = SlurmAllocation(hosts)
    atexit.register(allocation.release)
    try:
        allocation.start()
    except BaseException:
        allocation.release()
        raise
    _allocation = allocation
    _say(f"hosts.slurm: job {allocation.job_id} runs on " +
         ", ".join(f"{n} ({a})" for n, a in zip(allocation.names, allocation.addresses)))
    return dataclasses.replace(hosts, addresses=list(allocation.addresses), slurm=SlurmConfig())


def release_slurm() -> None:
    """Release this controller's SLURM allocation, if it has one (idempotent)."""
    if _allocation is not None:
        _allocation.release()


# -- the lifeline (forge.compat, 22) ----------------------------------------------------------------------------

_lifeline: tuple[str, int] | None = None
_lifeline_connections: list[socket.socket] = []  # held open for the life of this process
_LIFELINE_HELLO = b"forge lifeline/1\n"  # then the handshake's challenge (forge.job_auth)


def lifeline_address() -> tuple[str, int]:
    """A port on this controller's address that every other host's watch process connects to; the kernel closes
    those connections when this process ends, however it ends (a SIGKILL included). It holds only connections that
    proved they hold the job's secret: a stranger's is closed after the handshake."""
    global _lifeline
    if _lifeline is None:
        server = socket.create_server((controller_address(), 0))
        secret = job_auth.job_secret()

        def accept() -> None:
            while True:
                connection, _ = server.accept()
                threading.Thread(target=_hold_if_proved, args=(connection, secret), daemon=True).start()

        threading.Thread(target=accept, daemon=True, name="forge-lifeline").start()
        _lifeline = server.getsockname()[:2]
    return _lifeline


def _hold_if_proved(connection: socket.socket, secret: bytes) -> None:
    try:
        connection.settimeout(job_auth.HANDSHAKE_TIMEOUT_S)
        if job_auth.client_proved(connection, secret, _LIFELINE_HELLO):
            connection.settimeout(None)
            _lifeline_connections.append(connection)
            return
    except OSError:  # silent past the timeout, or gone
        pass
    connection.close()


class Lifeline(EndpointActor):
    """In a host's watch process: once the controller's lifeline closes, this host's processes of the job go."""

    def __init__(self, address: str, port: int) -> None:
        self.connection = job_auth.connect((address, port), job_auth.job_secret(), _LIFELINE_HELLO, timeout=None)
        # A controller whose machine vanishes sends no FIN: keepalive notices within ~25 s.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                self.connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        compat.kill_host_tree_when_closed(self.connection)
