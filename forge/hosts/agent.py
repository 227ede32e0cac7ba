"""The per-host agent of a multi-host job: a Monarch worker (`run_worker_loop_forever`) for each job in turn, with
forge's environment.

Run once on every host of the job, before the controller starts (the same port on every host):

    python -m forge.hosts.agent --addr 10.0.0.2 --port 26600 [--log-dir /tmp/forge-logs]

The worker spawns the job's processes on this host when the controller, attached to every host's worker
(forge.hosts.host_mesh), asks. They inherit this environment: forge's job deadlines and the tcp transport
(forge.compat), FORGE_HOST_LOG_DIR, the folder on this host where each remote process writes its output
(each remote process writes its output there: forge.compat, 20), and FORGE_HOST_ADDRESS, the
address given here, where forge's own servers on this host listen (the weight relay's). The job's secret comes
from the controller with the rest of a process's environment (forge.provisioner), never through this agent.

Monarch's worker and the processes it spawns authenticate nobody (the worker runs with
`ca="trust_all_connections"`): whoever reaches this port can start processes here and run code in them. The agent
says so when it starts (`TRUST_BOUNDARY`); run it only on a network that the job's hosts alone share
(docs/several_hosts.md, "Sockets and trust").
"""

from __future__ import annotations

import argparse
import getpass
import ipaddress
import os
import socket
import sys
from pathlib import Path

LOG_DIR_VARIABLE = "FORGE_HOST_LOG_DIR"
ADDRESS_VARIABLE = "FORGE_HOST_ADDRESS"
DEFAULT_LOG_DIR = "/tmp/forge-logs"
TRUST_BOUNDARY = (
    "forge host agent: trust boundary: Monarch's worker on {address}:{port} and the job processes it starts "
    "here accept connections without authentication (the worker trusts all connections): anyone who reaches "
    "{address} can start processes on this host and run code in them as user {user}. Run it only on a private "
    "network that this job's hosts alone share (docs/several_hosts.md, 'Sockets and trust').")


def host_address() -> str:
    """The address this host's job processes listen on: the agent's --addr (FORGE_HOST_ADDRESS), else what
    this host's name resolves to (which the agent checked is the same: forge.compat, 19)."""
    return os.environ.get(ADDRESS_VARIABLE) or socket.gethostbyname(socket.gethostname())


def own_address_problem(address: str) -> str | None:
    """Why this host's processes could not be reached at `address`, or None. Monarch's processes listen on
    the address their host's name resolves to (forge.compat, 19)."""
    name = socket.gethostname()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError as e:
        return f"this host's name {name!r} does not resolve ({e}); map it to {address} in /etc/hosts"
    if address not in resolved:
        return (f"this host's name {name!r} resolves to {sorted(resolved)}, not {address}: Monarch's processes "
                f"here would listen there; map {name!r} to {address} in /etc/hosts")
    return None


def worker_environment(log_dir: str, address: str) -> dict[str, str]:
    """The environment of this host's Monarch worker, which the job's processes here inherit; given to the worker's
    process, never written into this one's after Monarch started its threads (forge.compat, 30)."""
    from forge import compat  # JOB_ENVIRONMENT is in os.environ from here on

    return {**os.environ, compat.TRANSPORT_VARIABLE: "tcp", LOG_DIR_VARIABLE: log_dir, ADDRESS_VARIABLE: address}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forge.hosts.agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", required=True, help="this host's IP address, as the job's `hosts.addresses` lists it")
    parser.add_argument("--port", type=int, default=26600, help="the port every host's agent listens on")
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="where this host's job processes write their output")
    args = parser.parse_args(argv)
    try:
        ipaddress.ip_address(args.addr)
    except ValueError:
        parser.error(f"--addr {args.addr!r}: must be an IP address (Monarch's worker does not take host names)")
    problem = own_address_problem(args.addr)
    if problem:
        parser.error(problem)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    environment = worker_environment(args.log_dir, args.addr)
    from forge.hosts.config import worker_address

    address = worker_address(args.addr, args.port)
    print(f"forge host agent: Monarch worker on {address} (process output in {args.log_dir})", flush=True)
    print(TRUST_BOUNDARY.format(address=args.addr, port=args.port, user=getpass.getuser()), flush=True)
    serve_jobs(address, environment)
    return 1  # not reached


WORKER_RESTART_PAUSE_S = 0.5  # a worker that cannot start (port taken) is retried, not spun on


def serve_jobs(address: str, environment: dict[str, str]) -> None:
    """One Monarch worker per job, for ever: a job's end (`HostMesh.shutdown`) ends its worker's process, and the
    next job needs a fresh one on the same address."""
    import subprocess
    import time

    serve = ("from monarch.actor import run_worker_loop_forever; "
             f"run_worker_loop_forever(address={address!r}, ca='trust_all_connections')")
    while True:
        # `forge.hosts.agent` in its command line: how a job's process knows its host's worker (forge.compat, 22).
        code = subprocess.call([sys.executable, "-c", serve, "forge.hosts.agent"], env=environment)
        print(f"forge host agent: worker exited ({code}); starting the next", flush=True)
        time.sleep(WORKER_RESTART_PAUSE_S)


if __name__ == "__main__":
    sys.exit(main())
