"""Notices what fails on the job's meshes and sends each failure where it belongs.

Two sources: Monarch's supervision events (its hook, on a Monarch thread) and a pid watcher that polls the
processes themselves (this host's process table; another host's through its watch mesh, whose agent answers
for that host). A failure on a mesh that a service owns goes to the service (`ProvisionedMesh.on_failure`: it
re-routes and restarts the replica); any other is fatal and recorded in `fatal_failures`, which apps race their
main loop against to end the job fast with the root cause.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from forge import processes
from forge.hosts.config import HostsConfig
from forge.processes import ProcessId
from forge.provisioned_mesh import MONARCH_LOG_FORWARDER, MeshFailure, ProvisionedMesh

logger = logging.getLogger(__name__)

HOST_SILENT_POLLS = 10  # a host whose watch agent misses this many polls in a row (~10 s) is reported lost


class FailureWatch:
    """The failures of the meshes in `meshes` (the provisioner's own dict, read live)."""

    def __init__(self, meshes: dict[str, ProvisionedMesh], hosts: HostsConfig | None) -> None:
        self.meshes = meshes
        self.hosts = hosts
        self.host_watch: dict[int, ProvisionedMesh] = {}  # host index -> its watch mesh (other hosts only)
        self.retired: set[str] = set()  # meshes already stopped: Monarch keeps reporting their deaths for a while
        self.fatal_failures: list[MeshFailure] = []
        self.closing = False  # during shutdown a failure is expected, not fatal
        self._silent_polls: dict[int, int] = {}
        self._poller: asyncio.Task | None = None

    def watch_processes(self) -> None:
        """Start polling the processes (once; again after every mesh was gone)."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self.poll_processes())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def poll_processes(self, poll_s: float = 0.5) -> None:
        """Report a mesh whose process has exited within a second. Monarch notices a dead process only when
        its proc-state queries go unanswered for HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE (300 s here, so that
        busy processes on a loaded host are not declared dead): far too late for a job to fail fast.
        Processes of this host are read from its process table; another host's from its watch agent."""
        while self.meshes:
            await asyncio.sleep(poll_s)
            live = [m for m in self.meshes.values() if not (m.stopped or m.failed)]
            remote: dict[int, list[ProcessId]] = {}
            for mesh in live:
                for host, proc in zip(mesh.host_of_rank(), mesh.processes):
                    if not proc.local:
                        remote.setdefault(host, []).append(proc)
            answers = await asyncio.gather(*(self._dead_on_host(host, procs) for host, procs in remote.items()))
            dead = {proc for procs in answers for proc in procs}
            for mesh in live:
                gone = [p for p in mesh.processes if (not processes.is_alive(p.pid) if p.local else p in dead)]
                if gone and not mesh.failed:
                    self._report_gone(mesh, gone)

    def _report_gone(self, mesh: ProvisionedMesh, gone: list[ProcessId]) -> None:
        mesh.failed = True
        if mesh.reported:  # Monarch's supervision said it first
            return
        lost = [f"host {i} ({self.hosts.describe(i)})" for i in mesh.hosts
                if self.hosts is not None and i in self.host_watch and self.host_watch[i].failed]
        why = f"{' and '.join(lost)} stopped answering (its agent or the machine is gone)" if lost else \
            "killed or crashed"
        self.report(mesh, f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited ({why}; its actors "
                          "are lost)")

    async def _dead_on_host(self, host: int, procs: list[ProcessId]) -> list[ProcessId]:
        """Which of `procs` (all on host `host`) have exited, as that host's watch agent sees it. A host whose
        agent stops answering is lost, and every process of the job there with it."""
        watch = self.host_watch.get(host)
        if watch is None:
            return []
        if watch.failed:
            return list(procs)
        try:
            dead = await asyncio.wait_for(watch.agents.dead_among.call_one([p.pid for p in procs]), timeout=1.0)
            self._silent_polls[host] = 0
            return [p for p in procs if p.pid in dead]
        except Exception as e:
            self._silent_polls[host] = self._silent_polls.get(host, 0) + 1
            if self._silent_polls[host] < HOST_SILENT_POLLS:
                return []
            logger.error("host %d (%s) stopped answering: %r", host, self.hosts.describe(host), e)
            watch.failed = True
            return list(procs)

    def report(self, mesh: ProvisionedMesh | None, message: str) -> None:
        event = MeshFailure(mesh.name if mesh else "unknown", message)
        if mesh is not None:
            mesh.reported = True
        if mesh is not None and mesh.on_failure is not None:
            mesh.on_failure(event)
            return
        if self.closing:
            logger.debug("failure on mesh %s during shutdown: %s", event.mesh_name, message)
            return
        logger.error("fatal failure on mesh %s: %s", event.mesh_name, message)
        self.fatal_failures.append(event)

    def on_supervision_event(self, failure: Any) -> None:
        # Called by Monarch on its own thread (forge.compat, 4); must never raise. Monarch names the actor mesh
        # that failed; forge's actor meshes are named `<proc mesh>_<actor>` (`actor_mesh_name`).
        try:
            source = getattr(failure, "mesh_name", None) or str(failure)
            if source.startswith(MONARCH_LOG_FORWARDER):
                return  # the same process's death reaches us through its ProcAgent's actor mesh too
            if any(source.startswith(f"{name}_") for name in self.retired):
                return
            mesh = next((m for m in self.meshes.values() if source.startswith(f"{m.name}_")), None)
            if mesh is not None and mesh.stopped:
                return
            self.report(mesh, _with_gone_processes(mesh, str(failure)))
        except Exception:  # pragma: no cover - defensive
            logger.exception("error while handling a mesh failure")

    async def wait_for_fatal_failure(self) -> MeshFailure:
        """Returns when any mesh not owned by a service fails (apps race their main loop against it)."""
        while not self.fatal_failures:
            # The hook runs on a Monarch thread, where an asyncio primitive must not be touched: poll.
            await asyncio.sleep(0.2)
        return self.fatal_failures[0]


def _with_gone_processes(mesh: ProvisionedMesh | None, message: str) -> str:
    """Monarch's report, naming the processes of this host that are gone (Monarch 0.7 names neither them nor
    their pids, and its report usually beats the pid watcher's)."""
    gone = [p for p in (mesh.processes if mesh else []) if p.local and not processes.is_alive(p.pid)]
    if not gone:
        return message
    return f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited ({message})"
