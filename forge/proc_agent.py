"""`ProcAgent`: one small actor on every process of every provisioned mesh.

It tells the controller who its process is (host, pid, address), sets the process's environment
(CUDA_VISIBLE_DEVICES, RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) before any user actor exists, hands
the process's metrics to the controller each step, and on a host other than the controller's writes the
process's output to a file there (forge.compat, 20); on the controller's host a process inherits the controller's
stdout/stderr. On a host other than the controller's, the agent of the provisioner's
watch mesh answers for the liveness, memory and killing of that host's processes (pids mean nothing
elsewhere).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from forge import compat, metrics, processes
from forge.hosts.agent import DEFAULT_LOG_DIR, LOG_DIR_VARIABLE, host_address

from monarch.actor import Actor, current_rank, endpoint  # noqa: E402 (after forge.compat)


def own_address(local: bool) -> str:
    """The address other hosts reach this process's host at (the controller's host: loopback suffices)."""
    return "127.0.0.1" if local else host_address()


class ProcAgent(Actor):
    def __init__(self, controller_pid: int, controller_started: float, job_id: str, mesh_name: str) -> None:
        # On another host the controller's pid means nothing: its create time tells the hosts apart.
        self.local = processes.is_this_host(controller_pid, controller_started)
        compat.plain_log_messages()
        self.log_file = ""
        if not self.local:  # on the controller's host a process inherits the controller's stdout/stderr
            folder = Path(os.environ.get(LOG_DIR_VARIABLE, DEFAULT_LOG_DIR)) / job_id
            folder.mkdir(parents=True, exist_ok=True)
            self.log_file = str(folder / f"{mesh_name}.{current_rank().rank}.log")
            compat.route_output_to_file(self.log_file)

    @endpoint
    def identify(self) -> dict:
        """Who this process is, and a port free on its host (rank 0's becomes the mesh's MASTER_PORT)."""
        address = own_address(self.local)
        return {"rank": current_rank().rank, "host": socket.gethostname(), "pid": os.getpid(), "local": self.local,
                "address": address, "free_port": processes.free_port(address), "log_file": self.log_file}

    @endpoint
    def set_environment(self, shared: dict[str, str], per_rank: list[dict[str, str]]) -> None:
        os.environ.update(shared)
        os.environ.update(per_rank[current_rank().rank])

    @endpoint
    def drain_metrics(self) -> dict[str, metrics.Partial]:
        return metrics.drain_local()

    # -- a host's watch agent: about other processes of this host --------------------------------------------

    @endpoint
    def dead_among(self, pids: list[int]) -> list[int]:
        return processes.dead_among(pids)

    @endpoint
    def kill(self, pids: list[int]) -> None:
        processes.kill(pids)

    @endpoint
    def resident_memory(self, pids: dict[str, int]) -> dict[str, int]:
        return processes.resident_memory(pids)

    _handle_undeliverable_message = compat.drop_undeliverable
