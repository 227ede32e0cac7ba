"""`ProcAgent`: one small actor on every process of every provisioned mesh.

It sets the process's environment (CUDA_VISIBLE_DEVICES, RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT)
before any user actor exists, hands the process's metrics to the controller each step, and, on the
controller's host, applies the output and orphan workarounds of `forge.compat` (5, 6).
"""

from __future__ import annotations

import os

from forge import compat, metrics
from forge.processes import is_this_host

from monarch.actor import Actor, current_rank, endpoint  # noqa: E402 (after forge.compat)


class ProcAgent(Actor):
    def __init__(self, controller_pid: int, controller_started: float) -> None:
        if not is_this_host(controller_pid, controller_started):
            return  # on another host the controller's pid means nothing here
        compat.route_output_to_controller(controller_pid)
        compat.exit_with_controller(controller_pid)

    @endpoint
    def set_environment(self, shared: dict[str, str], per_rank: list[dict[str, str]]) -> int:
        os.environ.update(shared)
        os.environ.update(per_rank[current_rank().rank])
        return os.getpid()

    @endpoint
    def drain_metrics(self) -> dict[str, metrics.Partial]:
        return metrics.drain_local()

    _handle_undeliverable_message = compat.drop_undeliverable
