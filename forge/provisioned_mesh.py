"""What the provisioner hands out: a proc mesh with its agents, GPUs and processes, and how its failures are named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from forge.processes import ProcessId


class ShutDownError(RuntimeError):
    """The job is shutting down (or has shut down): no new process, actor, service or call."""


@dataclass
class MeshFailure:
    """A process or actor failure on a provisioned mesh, as Monarch (or the pid watcher) reported it."""

    mesh_name: str
    message: str


@dataclass
class ProvisionedMesh:
    name: str
    procs: Any  # monarch.actor.ProcMesh
    agents: Any  # the forge.proc_agent.ProcAgent actor mesh on it
    gpus: list[int]
    processes: list[ProcessId]  # by rank
    on_failure: Callable[[MeshFailure], None] | None = None
    stopped: bool = False
    failed: bool = False  # a process of this mesh is gone: reported once, never sent messages again
    reported: bool = False  # a failure of this mesh was reported (by Monarch or the watcher)
    actors: list[Any] = field(default_factory=list)  # actors here that define `teardown`: called before the stop
    hosts: list[int] = field(default_factory=list)  # indices in the `hosts` config; [] on this host only
    log_files: list[str] = field(default_factory=list)  # by rank: where a remote process's output goes

    @property
    def local(self) -> bool:
        return all(p.local for p in self.processes)

    @property
    def pids(self) -> list[int]:
        """The pids of a mesh on the controller's host (a remote pid means nothing here: use `processes`)."""
        if not self.local:
            raise ValueError(f"mesh {self.name!r} runs on other hosts ({', '.join(map(str, self.processes))}): "
                             "its processes are known by (host, pid) in `processes`")
        return [p.pid for p in self.processes]

    def host_of_rank(self) -> list[int]:
        """The host index of each rank (ranks run host by host); -1 on the controller's host."""
        per_host = len(self.processes) // max(1, len(self.hosts))
        return [self.hosts[rank // per_host] if self.hosts else -1 for rank in range(len(self.processes))]


# Every proc mesh runs Monarch's log forwarder, an actor mesh Monarch names `logger-<id>`.
MONARCH_LOG_FORWARDER = "logger-"


def actor_mesh_name(proc_mesh: str, actor: str) -> str:
    """The name of an actor mesh forge spawns on a proc mesh: Monarch reports a failure by that name."""
    return f"{proc_mesh}_{actor}"
