"""A node's Monarch worker in a SLURM allocation, with forge's environment (forge.hosts.slurm).

    srun python -m forge.hosts.slurm_worker [--log-dir DIR] -c CODE

`CODE` is the Python that runs the worker: the one Monarch's `SlurmJob` generates (it names this module as its
`python_exe`: forge.compat, 51), or forge's own in an allocation it runs in. This module checks that the node's
name resolves to its address (forge.compat, 19), then replaces itself with `python -c CODE forge.hosts.agent` in the
environment a hand-started agent gives its worker (forge.hosts.agent.worker_environment: the tcp transport, where
process output goes, the node's address) plus FORGE_SLURM_JOB. The process stays srun's task, so SLURM's signals
reach the worker directly; `forge.hosts.agent` in its command line is how the job's processes on this node know their
host's worker (forge.compat, 22), and FORGE_SLURM_JOB tells them to end it with the job's other processes when the
controller's lifeline closes: the allocation then ends with the worker.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from forge.hosts.agent import DEFAULT_LOG_DIR, own_address_problem, worker_environment
from forge.hosts.slurm import SLURM_JOB_VARIABLE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forge.hosts.slurm_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="where this node's job processes write output")
    parser.add_argument("-c", dest="code", required=True, help="the Python that runs this node's Monarch worker")
    args = parser.parse_args(argv)
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as e:
        print(f"forge slurm worker on {name}: this node's name does not resolve ({e})", file=sys.stderr, flush=True)
        return 2
    problem = own_address_problem(address)
    if problem is None and address.startswith("127."):
        problem = (f"this node's name {name!r} resolves to {address}, a loopback address: the controller could not "
                   f"reach its processes; map {name!r} to the node's network address in /etc/hosts")
    if problem:
        print(f"forge slurm worker on {name}: {problem}", file=sys.stderr, flush=True)
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    environment = {**worker_environment(args.log_dir, address), SLURM_JOB_VARIABLE: os.environ.get("SLURM_JOB_ID", "?")}
    print(f"forge slurm worker on {name} ({address}), job {environment[SLURM_JOB_VARIABLE]}", flush=True)
    os.execve(sys.executable, [sys.executable, "-c", args.code, "forge.hosts.agent"], environment)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
