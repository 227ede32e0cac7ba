"""A real SLURM on one machine, for the tests of `hosts.slurm` (root only).

Debian's slurmctld, slurmd and munge (installed with apt when missing: `install_slurm`). Each node is a simulated
host (tests/multihost_support.py: a network namespace with an address from 198.18.0.0/15, its own hostname, hosts
file, /dev/shm and PID namespace) whose one program is `slurmd -N <its name>`; slurmctld and munged run on the test's
controller host (the bridge's address), each with files of its own under the run's folder: a key, a socket, state,
spool and logs. `SlurmCluster.close()` cancels every job, stops every daemon and removes the namespaces and files,
also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from tests.multihost_support import PREFIX, SimulatedHost, SimulatedHosts, remove_leftovers

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "munged")
PARTITION = "forge"
SLURMD_PORT = 6818  # each node has an address of its own, so every slurmd takes the same port
START_TIMEOUT_S = 60.0
KILL_WAIT_S = 10  # slurm's KillWait here: a cancelled job's processes get SIGKILL this long after SIGTERM


def install_slurm(timeout_s: float = 900) -> None:
    """Install slurm and munge with apt when a program is missing (root; the only packages `make test` installs)."""
    if all(shutil.which(program) for program in PROGRAMS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        if result.returncode != 0 and command[1] == "install":
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr[-2000:]}")
    missing = [program for program in PROGRAMS if not shutil.which(program)]
    if missing:
        raise RuntimeError(f"after installing {' '.join(PACKAGES)}, still missing: {missing}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def remove_leftover_daemons() -> list[int]:
    """Kill the munged and slurmctld of earlier runs whose test process is gone (their files are under
    /tmp/<PREFIX><pid>/slurm; slurmd went with its host's namespace)."""
    killed = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        text = " ".join(proc.info["cmdline"] or [])
        match = re.search(rf"/tmp/{PREFIX}(\d+)/slurm/", text)
        if match and proc.info["cmdline"][0].rsplit("/", 1)[-1] in ("munged", "slurmctld") \
                and not psutil.pid_exists(int(match.group(1))):
            with contextlib.suppress(psutil.Error):
                proc.kill()
                killed.append(proc.pid)
    return killed


class SlurmHosts(SimulatedHosts):
    """Simulated hosts whose program is slurmd, named after the host."""

    conf: Path

    def host_program(self, host: SimulatedHost) -> str:
        # `ip netns exec` mounts a sysfs of its own: no cgroup file system under it, which slurmd 22.05 needs to
        # start even with no cgroup plugin in use (cgroup.conf: v1, mounted as needed).
        return f'sh -c "mount -t tmpfs cgroup /sys/fs/cgroup && exec slurmd -D -N {host.name} -f {self.conf}"'



class SlurmCluster:
    """munged, slurmctld and `count` nodes (slurmd in simulated hosts) in one partition, `PARTITION`."""

    def __init__(self, count: int = 2) -> None:
        self.hosts = SlurmHosts(count=count, port=SLURMD_PORT)
        self.folder = self.hosts.folder / "slurm"
        self.conf = self.folder / "slurm.conf"
        self.hosts.conf = self.conf
        self.controller_name = f"{self.hosts.tag}ctl"
        self.daemons: list[subprocess.Popen] = []

    @property
    def nodes(self) -> list[SimulatedHost]:
        return self.hosts.hosts

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process that uses this cluster (sbatch, squeue, a forge controller)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        install_slurm()
        remove_leftover_daemons()
        remove_leftovers()
        self.hosts._make_network()  # the bridge first: slurmctld listens on its address
        self.folder.mkdir(parents=True, exist_ok=True)
        names, addresses = [h.name for h in self.nodes], [h.address for h in self.nodes]
        self._start_munge()
        self._write_conf(names, addresses)
        self._start_slurmctld()
        self.hosts._start_agents()  # each host's slurmd
        self._add_nodes_to_this_hosts_file(names, addresses)
        self._wait_for_nodes_idle(names)

    def _start_munge(self) -> None:
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.folder / "munge.socket"
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.folder / 'munged.pid'}", f"--log-file={self.folder / 'munged.log'}",
                               f"--seed-file={self.folder / 'munged.seed'}"])
        self._until(lambda: self.munge_socket.exists(), "munged's socket")

    def _write_conf(self, names: list[str], addresses: list[str]) -> None:
        self.slurmctld_port = _free_port()
        for sub in ("state", "spool", "log", *(f"spool/{name}" for name in names)):
            (self.folder / sub).mkdir(exist_ok=True)
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
        cpus = os.cpu_count() or 1
        lines = [
            f"ClusterName={self.hosts.tag}",
            f"SlurmctldHost={self.controller_name}({self.hosts.controller_address})",
            f"SlurmctldPort={self.slurmctld_port}",
            f"SlurmdPort={SLURMD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthType=auth/munge",
            f"CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.folder / 'state'}",
            f"SlurmdSpoolDir={self.folder / 'spool'}/%n",
            f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.folder / 'spool'}/%n.pid",
            f"SlurmctldLogFile={self.folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.folder / 'log'}/%n.log",
            "SlurmdParameters=config_overrides",  # the nodes' CPUs as declared here, whatever the machine has
            "ProctrackType=proctrack/linuxproc",  # no cgroups: the nodes are namespaces of one machine
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=10",
            "SchedulerParameters=sched_interval=2",
            "InactiveLimit=0",
            *(f"NodeName={name} NodeAddr={address} NodeHostname={name} CPUs={cpus} State=UNKNOWN"
              for name, address in zip(names, addresses)),
            f"PartitionName={PARTITION} Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_slurmctld(self) -> None:
        # It runs on this controller host (its hostname is the SlurmctldHost's name: relaunch_as_controller_host).
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: self.run("scontrol", "ping", check=False).returncode == 0
                    and "UP" in self.run("scontrol", "ping", check=False).stdout, "slurmctld answering")

    def _add_nodes_to_this_hosts_file(self, names: list[str], addresses: list[str]) -> None:
        """This controller host resolves the nodes' names as a cluster's login node does (Monarch's SlurmJob
        names workers by host name). /etc/hosts here is this test's own (relaunch_as_controller_host)."""
        with open("/etc/hosts", "a") as hosts:
            hosts.writelines(f"{address} {name}\n" for name, address in zip(names, addresses))

    def _wait_for_nodes_idle(self, names: list[str]) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "-N", "-h", "-o", "%N %T", check=False).stdout.split("\n")
            states = dict(line.split()[:2] for line in out if len(line.split()) >= 2)
            return all(states.get(name) == "idle" for name in names)
        self._until(idle, "every node idle in sinfo")

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self.folder / f"{name}.out").open("w")
        self.daemons.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env, start_new_session=True))

    def _until(self, ok, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"slurm test cluster: waiting for {what}: " + (f"{dead} exited; " if dead else
                                   f"not within {timeout_s} s; ") + self.logs())
            time.sleep(0.3)

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for path in sorted(self.folder.glob("*.out")) + sorted((self.folder / "log").glob("*.log")):
            with contextlib.suppress(OSError):
                parts.append(f"\n--- {path.name}:\n{path.read_text(errors='replace')[-tail:]}")
        return "".join(parts)

    def run(self, *command: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
        return result

    def queue(self) -> list[str]:
        """Every job squeue shows (its default states: pending, running, completing...), as 'ID STATE NAME'."""
        return self.run("squeue", "-h", "-o", "%i %T %j").stdout.split("\n")

    def jobs(self) -> list[str]:
        return [line for line in self.queue() if line.strip()]

    def job_processes(self, node: SimulatedHost) -> list[psutil.Process]:
        """Every live process on `node` but its init and its slurmd: what a job left there."""
        init = node.init_pid()
        found = []
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(init).children(recursive=True) if init else []:
                with contextlib.suppress(psutil.Error):
                    if proc.status() != psutil.STATUS_ZOMBIE and proc.name() != "slurmd":
                        found.append(proc)
        return found

    def close(self) -> None:
        """Cancel every job, stop slurmd (with its host), slurmctld and munged, remove everything (idempotent)."""
        if self.conf.exists():
            with contextlib.suppress(Exception):
                self.run("scancel", "--full", f"--partition={PARTITION}", check=False, timeout=10)
        self.hosts.close()  # kills every process on every node (slurmd, slurmstepd, job processes), removes the folder
        for daemon in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=10)
        self.daemons.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
