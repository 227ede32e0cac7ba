"""The `hosts` section of a job's config: which machines a job spans and which roles run where (no torch,
no Monarch: a bad section is refused before anything starts).

    hosts:
      addresses: [10.0.0.2, 10.0.0.3]   # each host runs `python -m forge.hosts.agent --addr IP --port PORT`
      port: 26600
      procs_per_host: 8                 # optional: refuse a placement that needs more
      roles: {trainer: [0], generator: [1]}

Or the hosts come from SLURM (forge/hosts/slurm.py: Monarch's job API submits the workers with sbatch, and the job
ends with them):

    hosts:
      slurm: {nodes: 2, partition: gpu, time: "04:00:00"}
      roles: {trainer: [0], generator: [1]}   # indices into the allocated nodes, in squeue's order

A role is a mesh's name (an actor's `mesh_name`, or its class name in lower case); roles not listed run on the
first host. Empty (the default): everything on this host.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

def worker_address(address: str, port: int) -> str:
    """Where the Monarch worker of the host agent at `address` listens (forge.hosts.agent)."""
    return f"tcp://{address}:{port}"


class HostsError(ValueError):
    """A `hosts` section that cannot work; the message names the field, the value and what is allowed."""


# sbatch's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
# sbatch options forge sets itself (one Monarch worker per node, its own job name and output files)
_SBATCH_OWN = ("-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-J", "--job-name", "-o", "--output", "-e",
               "--error", "-p", "--partition", "-t", "--time", "-A", "--account", "-q", "--qos", "--gpus-per-node")


@dataclass
class SlurmConfig:
    """The hosts of a job as a SLURM allocation (docs/hosts.md, "On a SLURM cluster"); `nodes: 0`: not used."""

    nodes: int = 0
    """How many nodes to allocate (one Monarch worker each); 0: no SLURM."""
    partition: str | None = None
    """sbatch --partition (null: the cluster's default partition)."""
    time: str | None = None
    """sbatch --time, e.g. "04:00:00" or "1-00:00:00" (null: the partition's default limit)."""
    account: str | None = None
    """sbatch --account (null: the user's default)."""
    qos: str | None = None
    """sbatch --qos (null: the default)."""
    gpus_per_node: int | None = None
    """sbatch --gpus-per-node (null: no GPUs asked for)."""
    sbatch_args: list[str] = field(default_factory=list)
    """More sbatch options, each one "--option=value" (e.g. "--constraint=h100"); not those forge sets."""
    start_timeout_s: float = 600.0
    """A job still queued after this long is cancelled, and the error says why it waited."""
    in_allocation: bool = False
    """The controller runs inside an allocation already (a user's own sbatch script): its workers go on the
    allocation's nodes with srun, nothing is submitted (docs/hosts.md)."""
    log_dir: str = "slurm-logs"
    """Where the workers' sbatch output and each node's process logs go (a path every node sees)."""

    @property
    def enabled(self) -> bool:
        return self.nodes > 0

    def validate(self, path: str = "hosts.slurm") -> SlurmConfig:
        if self.nodes < 0:
            raise HostsError(f"{path}.nodes={self.nodes}: must be >= 1 (or 0: no SLURM)")
        if not self.enabled:
            return self
        if self.start_timeout_s <= 0:
            raise HostsError(f"{path}.start_timeout_s={self.start_timeout_s}: must be > 0")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise HostsError(f"{path}.gpus_per_node={self.gpus_per_node}: must be >= 0 (or null)")
        if self.time is not None and not _SLURM_TIME.fullmatch(self.time):
            raise HostsError(f"{path}.time={self.time!r}: not a SLURM time; allowed: MM, MM:SS, HH:MM:SS, D-HH, "
                             "D-HH:MM, D-HH:MM:SS")
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[\w.+-]+", value):
                raise HostsError(f"{path}.{name}={value!r}: must be a SLURM name (letters, digits, _ . + -)")
        for i, arg in enumerate(self.sbatch_args):
            if not arg.startswith("-") or any(c.isspace() for c in arg):
                raise HostsError(f"{path}.sbatch_args[{i}]={arg!r}: must be one sbatch option, e.g. "
                                 "'--constraint=h100' (no spaces)")
            option = arg.split("=", 1)[0]
            if option in _SBATCH_OWN:
                raise HostsError(f"{path}.sbatch_args[{i}]={arg!r}: forge sets {option} itself; use the "
                                 f"{path} fields (nodes, partition, time, account, qos, gpus_per_node)")
        if not self.log_dir:
            raise HostsError(f"{path}.log_dir: must name a folder")
        return self


@dataclass
class HostsConfig:
    """Several hosts: the per-host agents or a SLURM allocation, and the hosts each mesh runs on (docs/hosts.md)."""

    addresses: list[str] = field(default_factory=list)
    """IPs where the per-host agents listen (`python -m forge.hosts.agent`); empty: this host only."""
    port: int = 26600
    """The agents' port, the same on every host."""
    procs_per_host: int | None = None
    """How many processes a host offers (null: not checked)."""
    roles: dict[str, list[int]] = field(default_factory=dict)
    """A mesh's name -> the indices of its hosts; unlisted roles run on host 0."""
    connect_timeout_s: float = 3.0
    """The reachability check's bound per host."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The hosts from a SLURM allocation instead of `addresses` (forge/hosts/slurm.py)."""

    @property
    def enabled(self) -> bool:
        return bool(self.addresses) or self.slurm.enabled

    @property
    def count(self) -> int:
        return self.slurm.nodes if self.slurm.enabled and not self.addresses else len(self.addresses)

    def validate(self, path: str = "hosts") -> HostsConfig:
        """Everything that can be checked without the network; raises HostsError naming the field."""
        if not 0 < self.port < 65536:
            raise HostsError(f"{path}.port={self.port}: must be a TCP port (1..65535)")
        if self.connect_timeout_s <= 0:
            raise HostsError(f"{path}.connect_timeout_s={self.connect_timeout_s}: must be > 0")
        if self.procs_per_host is not None and self.procs_per_host < 1:
            raise HostsError(f"{path}.procs_per_host={self.procs_per_host}: must be >= 1 (or unset)")
        self.slurm.validate(f"{path}.slurm")
        if self.slurm.enabled and self.addresses:
            raise HostsError(f"{path}.slurm.nodes={self.slurm.nodes} and {path}.addresses={self.addresses}: the hosts "
                             "come from SLURM or from the listed agents, not both; give one")
        seen: dict[str, int] = {}
        for i, address in enumerate(self.addresses):
            where = f"{path}.addresses[{i}]={address!r}"
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                raise HostsError(f"{where}: must be an IP address; Monarch's workers take no host names "
                                 f"(resolve it first, e.g. `getent hosts {address}`)") from None
            if ip.is_loopback or ip.is_unspecified:
                raise HostsError(f"{where}: a loopback or unspecified address cannot name a host of a multi-host "
                                 "job (Monarch switches to a local-only mode); give the host's network address")
            if str(ip) in seen:
                raise HostsError(f"{where}: duplicate of {path}.addresses[{seen[str(ip)]}]; each host once")
            seen[str(ip)] = i
        for role, indices in self.roles.items():
            if not indices:
                raise HostsError(f"{path}.roles.{role}=[]: list at least one host index")
            for index in indices:
                if not 0 <= index < self.count and self.slurm.enabled:
                    raise HostsError(f"{path}.roles.{role}: node index {index} is out of range: "
                                     f"{path}.slurm.nodes={self.slurm.nodes} (indices 0..{self.count - 1}); "
                                     f"ask for more nodes or place fewer roles apart")
                if not 0 <= index < self.count:
                    raise HostsError(f"{path}.roles.{role}: host index {index} is out of range; the job has "
                                     f"{self.count} hosts (indices 0..{self.count - 1})")
            if len(set(indices)) != len(indices):
                raise HostsError(f"{path}.roles.{role}={indices}: a host is listed twice")
        return self

    def hosts_of(self, role: str) -> list[int]:
        """The host indices a role runs on (the first host for a role the config does not place)."""
        return list(self.roles.get(role, [0]))

    def check_capacity(self, used: dict[int, int], host: int, procs: int, what: str, path: str = "hosts") -> None:
        """Refuse `procs` more processes on `host` when that exceeds `procs_per_host` (`used`: live counts)."""
        if self.procs_per_host is not None and used.get(host, 0) + procs > self.procs_per_host:
            raise HostsError(f"{path}.procs_per_host={self.procs_per_host}: {what} needs {procs} process(es) on host "
                             f"{host} ({self.describe(host)}), which already runs {used.get(host, 0)}")

    def describe(self, host: int) -> str:
        return self.addresses[host]

    def check_reachable(self, path: str = "hosts") -> None:
        """A bounded TCP connect to every host's agent, all at once; raises naming every host that failed."""
        def problem(address: str) -> str | None:
            try:
                with socket.create_connection((address, self.port), timeout=self.connect_timeout_s):
                    return None
            except OSError as e:
                return str(e) or type(e).__name__

        with ThreadPoolExecutor(max_workers=max(1, len(self.addresses))) as pool:
            problems = list(pool.map(problem, self.addresses))
        failed = [f"{path}.addresses[{i}]={a!r}: no agent answers on port {self.port} ({p})"
                  for i, (a, p) in enumerate(zip(self.addresses, problems)) if p]
        if failed:
            raise HostsError("unreachable host(s): " + "; ".join(failed) + ". Start `python -m forge.hosts.agent "
                             f"--addr IP --port {self.port}` on each, and check the network between them")
