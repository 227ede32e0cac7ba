"""The `hosts` section of a job's config: which machines a job spans and which roles run where (no torch,
no Monarch: a bad section is refused before anything starts).

    hosts:
      addresses: [10.0.0.2, 10.0.0.3]   # each host runs `python -m forge.hosts.agent --addr IP --port PORT`
      port: 26600
      procs_per_host: 8                 # optional: refuse a placement that needs more
      roles: {trainer: [0], generator: [1]}

A role is a mesh's name (an actor's `mesh_name`, or its class name in lower case); roles not listed run on the
first host. Empty (the default): everything on this host.
"""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

def worker_address(address: str, port: int) -> str:
    """Where the Monarch worker of the host agent at `address` listens (forge.hosts.agent)."""
    return f"tcp://{address}:{port}"


class HostsError(ValueError):
    """A `hosts` section that cannot work; the message names the field, the value and what is allowed."""


@dataclass
class HostsConfig:
    """Several hosts: the per-host agents, and the hosts each mesh runs on (docs/hosts.md)."""

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

    @property
    def enabled(self) -> bool:
        return bool(self.addresses)

    @property
    def count(self) -> int:
        return len(self.addresses)

    def validate(self, path: str = "hosts") -> HostsConfig:
        """Everything that can be checked without the network; raises HostsError naming the field."""
        if not 0 < self.port < 65536:
            raise HostsError(f"{path}.port={self.port}: must be a TCP port (1..65535)")
        if self.connect_timeout_s <= 0:
            raise HostsError(f"{path}.connect_timeout_s={self.connect_timeout_s}: must be > 0")
        if self.procs_per_host is not None and self.procs_per_host < 1:
            raise HostsError(f"{path}.procs_per_host={self.procs_per_host}: must be >= 1 (or unset)")
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
