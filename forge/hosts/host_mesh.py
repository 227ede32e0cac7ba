"""A Monarch host mesh over the hosts of a `hosts` config section (forge.hosts.config): the controller attaches to
the Monarch worker that every host's agent runs (`python -m forge.hosts.agent`). Everything that can be
refused is refused before the first Monarch call."""

from __future__ import annotations

import ipaddress
import socket
import threading

from forge import compat
from forge.endpoints import EndpointActor
from forge import job_auth
from forge.hosts.config import HostsConfig, HostsError, worker_address

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
    """Check the section (fields, reachable agents, this controller's own address) and switch this process to
    tcp (forge.compat, 17); raises HostsError naming the field."""
    hosts.validate()
    if not hosts.enabled:
        raise HostsError("hosts: no addresses: a host mesh needs at least one")
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
    return attach_to_workers(ca="trust_all_connections", name=name,
                             workers=[worker_address(address, hosts.port) for address in hosts.addresses])


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
