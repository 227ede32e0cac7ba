"""The provisioner: allocates Monarch proc meshes, assigns GPUs, sets the distributed environment, and
stops everything it made.

One provisioner lives in the controller process (`get_provisioner()`). Every proc mesh it spawns gets
a small `ProcAgent` actor on each process that sets that process's environment (CUDA_VISIBLE_DEVICES,
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) before any user actor exists, and that hands the
process's metrics to the controller each step.

Failures: Monarch's default reaction to a dead process is to exit the controller. The provisioner
replaces that hook: a failure on a mesh that a service owns goes to the service (which re-routes and
restarts the replica); any other failure is fatal and is recorded in `fatal_failures`, which apps watch
to end the job fast with the root cause.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from forge import compat, metrics, processes, weight_store
from forge.proc_agent import ProcAgent
from forge.processes import free_port, kill_job_processes, monarch_children  # noqa: F401 (public here too)

import psutil  # noqa: E402
from monarch.actor import HostMesh, ProcMesh, this_host  # noqa: E402

logger = logging.getLogger(__name__)


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
    procs: ProcMesh
    agents: ProcAgent
    gpus: list[int]
    pids: list[int]
    on_failure: Callable[[MeshFailure], None] | None = None
    stopped: bool = False
    failed: bool = False  # a process of this mesh is gone: reported once, never sent messages again
    actors: list[Any] = field(default_factory=list)  # actors here that define `teardown`: called before the stop


def _visible_gpus() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:  # no CUDA runtime at all
        return []


SPAWN_WAIT_S = 120.0  # how long shutdown waits for spawns already under way (a loaded host is slow)
DRAIN_WAIT_S = 10.0  # how long shutdown lets calls in flight finish before stopping their processes


@dataclass
class Provisioner:
    """Allocates proc meshes on this host (or on a configured Monarch host mesh) and stops them all."""

    host_mesh: HostMesh | None = None
    gpus: list[int] = field(default_factory=_visible_gpus)
    meshes: dict[str, ProvisionedMesh] = field(default_factory=dict)
    fatal_failures: list[MeshFailure] = field(default_factory=list)
    services: list[Any] = field(default_factory=list)  # stopped first at shutdown
    _names: itertools.count = field(default_factory=itertools.count)
    # Names of meshes already stopped: Monarch keeps reporting their deaths for a while.
    _retired: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        compat.configure_job_environment()
        compat.append_mode_for_file_output()
        with contextlib.suppress(RuntimeError):  # created outside a running loop: nothing to quiet
            compat.ignore_results_of_cancelled_calls(asyncio.get_running_loop())
        self._free_gpus = list(self.gpus)
        self._closing = False
        self._busy: set[asyncio.Future] = set()  # spawns (and actor set-ups) under way
        self._weight_store_started = False
        self._watcher: asyncio.Task | None = None
        self._store_mesh: ProvisionedMesh | None = None
        weight_store.job_id()  # this controller's pid names the job's shared-memory segments
        weight_store.remove_dead_jobs_segments()
        # A script that ends without `shutdown()` must not leave its weights in shared memory.
        atexit.register(weight_store.remove_job_segments)

    @property
    def closing(self) -> bool:
        return self._closing

    def refuse_if_closing(self, what: str) -> None:
        if self._closing:
            raise ShutDownError(f"{what}: the job is shutting down; nothing new is started")

    @contextlib.asynccontextmanager
    async def busy(self, what: str) -> AsyncIterator[None]:
        """Marks work (a spawn, an actor's set-up) that shutdown must let finish before it stops processes:
        killing a mesh Monarch is still spawning panics the controller (forge.compat, 10)."""
        self.refuse_if_closing(what)
        done = asyncio.get_running_loop().create_future()
        self._busy.add(done)
        try:
            yield
        finally:
            self._busy.discard(done)
            done.set_result(None)

    async def start_weight_store(self) -> None:
        """Start torchstore's controller and storage volume (once); keys of the weight store live there."""
        if not self._weight_store_started:
            # The storage volume runs on a mesh of ours, so its output bypasses Monarch's host like every
            # other process's (ProcAgent) and its death is reported like any other mesh's.
            self._store_mesh = await self.get_proc_mesh(1, mesh_name="weight_store")
            await compat.import_torchstore().initialize(mesh=self._store_mesh.procs)
            self._weight_store_started = True

    async def get_proc_mesh(
        self,
        procs: int = 1,
        *,
        hosts: int | None = None,
        with_gpus: bool = False,
        mesh_name: str | None = None,
        env: dict[str, str] | None = None,
        on_failure: Callable[[MeshFailure], None] | None = None,
    ) -> ProvisionedMesh:
        """Spawn `procs` processes (per host) with their environment set; fails before spawning on bad requests."""
        if procs < 1:
            raise ValueError(f"procs={procs}: must be >= 1")
        if hosts not in (None, 1):
            if self.host_mesh is None:
                raise ValueError(
                    f"hosts={hosts}: more than one host needs a Monarch host mesh; "
                    "create the Provisioner with host_mesh=monarch.actor.hosts_from_config(...)"
                )
            if hosts > len(self.host_mesh.region.slice()):
                raise ValueError(f"hosts={hosts}: the configured host mesh has {len(self.host_mesh.region.slice())} hosts")
        if with_gpus and procs > len(self._free_gpus):
            raise ValueError(
                f"mesh {mesh_name or 'anon'!r} asks for {procs} GPUs (with_gpus=True, procs={procs}) but only "
                f"{len(self._free_gpus)} of {len(self.gpus)} GPUs on this host are free: {self._free_gpus}"
            )
        name = f"{mesh_name or 'mesh'}-{next(self._names)}"
        async with self.busy(f"spawning mesh {name!r}"):
            # Shielded: a caller that is cancelled (a service stopping a restart) does not abort Monarch's
            # spawn half-way; the mesh is registered anyway, and shutdown stops it.
            mesh = await asyncio.shield(self._spawn(name, procs, with_gpus, env, on_failure))
        self.refuse_if_closing(f"spawning mesh {name!r}")  # shutdown began meanwhile: it stops this mesh
        return mesh

    async def _spawn(self, name: str, procs: int, with_gpus: bool, env: dict[str, str] | None,
                     on_failure: Callable[[MeshFailure], None] | None) -> ProvisionedMesh:
        gpus: list[int] = []
        if with_gpus:
            gpus, self._free_gpus = self._free_gpus[:procs], self._free_gpus[procs:]
        host = self.host_mesh if self.host_mesh is not None else this_host()
        try:
            proc_mesh = host.spawn_procs(per_host={"procs": procs}, name=name)
            agents = proc_mesh.spawn("proc_agent", ProcAgent, os.getpid(), psutil.Process().create_time())
            shared = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(procs),
                "FORGE_JOB_ID": weight_store.job_id(),
                **(env or {}),
            }
            # Each process sees only its own GPU, always as cuda:0.
            per_rank = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(procs),
                         "CUDA_VISIBLE_DEVICES": str(gpus[rank]) if gpus else ""} for rank in range(procs)]
            pids = list((await agents.set_environment.call(shared, per_rank)).values())
        except BaseException:
            self._free_gpus = sorted(self._free_gpus + gpus)
            raise
        mesh = ProvisionedMesh(name, proc_mesh, agents, gpus, pids, on_failure)
        self.meshes[name] = mesh
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_processes())
        logger.debug("provisioned mesh %s: %d procs (pids %s), gpus %s", name, procs, pids, gpus)
        return mesh

    async def _watch_processes(self, poll_s: float = 0.5) -> None:
        """Report a mesh whose process has exited within a second. Monarch notices a dead process only when
        its proc-state queries go unanswered for HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE (300 s here, so that
        busy processes on a loaded host are not declared dead): far too late for a job to fail fast."""
        while self.meshes:
            await asyncio.sleep(poll_s)
            for mesh in list(self.meshes.values()):
                if mesh.stopped or mesh.failed:
                    continue
                gone = [pid for pid in mesh.pids if not processes.is_alive(pid)]
                if gone:
                    mesh.failed = True
                    self._report(mesh, f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited "
                                       f"(killed or crashed; its actors are lost)")

    def _report(self, mesh: ProvisionedMesh | None, message: str) -> None:
        event = MeshFailure(mesh.name if mesh else "unknown", message)
        if mesh is not None and mesh.on_failure is not None:
            mesh.on_failure(event)
            return
        if self._closing:
            logger.debug("failure on mesh %s during shutdown: %s", event.mesh_name, message)
            return
        logger.error("fatal failure on mesh %s: %s", event.mesh_name, message)
        self.fatal_failures.append(event)

    def on_supervision_event(self, failure: Any) -> None:
        # Called by Monarch on its own thread (forge.compat, 4); must never raise.
        try:
            message = str(failure)
            if any(f"{name}_" in message for name in self._retired):
                return
            mesh = next((m for m in self.meshes.values() if f"{m.name}_" in message), None)
            if mesh is not None and mesh.stopped:
                return
            self._report(mesh, message)
        except Exception:  # pragma: no cover - defensive
            logger.exception("error while handling a mesh failure")

    async def wait_for_fatal_failure(self) -> MeshFailure:
        """Returns when any mesh not owned by a service fails (apps race their main loop against it)."""
        while not self.fatal_failures:
            # The hook runs on a Monarch thread, where an asyncio primitive must not be touched: poll.
            await asyncio.sleep(0.2)
        return self.fatal_failures[0]

    def memory_rss(self) -> dict[str, int]:
        """Resident memory in bytes of the controller and of every live process of every mesh, by name."""
        return processes.resident_memory({f"{mesh.name}[{rank}]": pid for mesh in self.meshes.values()
                                          for rank, pid in enumerate(mesh.pids)})

    async def collect_metrics(self) -> list[dict[str, metrics.Partial]]:
        """Every live process's partial metrics since the last call, plus the controller's own."""
        groups = [metrics.drain_local()]
        for mesh in list(self.meshes.values()):
            if mesh.stopped or mesh.failed:
                continue
            try:
                values = await asyncio.wait_for(mesh.agents.drain_metrics.call(), timeout=10)
                groups.extend(values.values())
            except Exception as e:  # a dead replica's metrics are lost with it; the service reports the death
                logger.debug("metrics from mesh %s unavailable: %s", mesh.name, e)
        return groups

    async def stop_proc_mesh(self, mesh: ProvisionedMesh, timeout: float = 20.0) -> None:
        if mesh.stopped:
            return
        mesh.stopped = True
        self._retired.add(mesh.name)
        if mesh.failed or not all(processes.is_alive(pid) for pid in mesh.pids):
            # A mesh that lost a process cannot be stopped through Monarch (the requests wait for answers
            # that never come): kill what is left of it.
            processes.kill(mesh.pids)
        else:
            # Let actors finish what they are doing (background tasks, in-flight store requests): a reply
            # sent to an actor that is already gone is a supervision failure (forge.compat, 8).
            for actor in mesh.actors:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(actor.teardown.call(), timeout=10)
            try:
                await asyncio.wait_for(mesh.procs.stop(), timeout=timeout)
            except Exception as e:
                # Only a mesh that did not stop cleanly is killed (forge.compat, 10).
                logger.debug("stopping mesh %s: %s", mesh.name, e)
                processes.kill(mesh.pids)
        self._free_gpus = sorted(self._free_gpus + mesh.gpus)
        self.meshes.pop(mesh.name, None)

    async def shutdown(self) -> None:
        """Stop everything this provisioner made, in order: services (their restarts, then their calls in
        flight, bounded), spawns under way (let finish), every mesh (in parallel), the weight store, and
        the job's shared memory. Leaves no child process and no segment; a second call does nothing."""
        if self._closing:
            return
        self._closing = True
        await asyncio.gather(*(service.stop() for service in list(self.services)), return_exceptions=True)
        if self._busy:
            logger.info("shutdown: waiting for %d spawn(s) under way", len(self._busy))
            await asyncio.wait(list(self._busy), timeout=SPAWN_WAIT_S)
        if self._watcher is not None:
            self._watcher.cancel()
        store_mesh = self._store_mesh
        # The store outlives the actors that use it (generators finish in-flight fetches in teardown).
        await asyncio.gather(*(self.stop_proc_mesh(m) for m in list(self.meshes.values()) if m is not store_mesh))
        if self._weight_store_started:
            self._weight_store_started = False
            torchstore = compat.import_torchstore()
            if store_mesh is not None and not store_mesh.failed:
                try:
                    await asyncio.wait_for(torchstore.shutdown(), timeout=20)
                except Exception as e:
                    logger.debug("torchstore shutdown: %s", e)
            torchstore.reset_client()
        if store_mesh is not None:
            await self.stop_proc_mesh(store_mesh)
            self._store_mesh = None
        kill_job_processes(hosts=False)


_provisioner: Provisioner | None = None
_shutting_down: asyncio.Future | None = None


def get_provisioner() -> Provisioner:
    """The controller's provisioner (created on first use, or after a shutdown)."""
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner()
        compat.install_fault_hook(_provisioner.on_supervision_event)
    return _provisioner


async def shutdown() -> None:
    """Stop every service, actor and mesh this controller started. Safe in any state: twice, concurrently
    (callers wait for the one shutdown), during start-up, with a restart or a hung call in flight."""
    global _provisioner, _shutting_down
    if _shutting_down is not None and not _shutting_down.done():
        await asyncio.shield(_shutting_down)
        return
    if _provisioner is None:
        return
    _shutting_down = asyncio.ensure_future(_provisioner.shutdown())
    try:
        await asyncio.shield(_shutting_down)
    finally:
        _provisioner = None
