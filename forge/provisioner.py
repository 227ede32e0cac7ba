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
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import forge.native

forge.native.setup()

import monarch.actor  # noqa: E402
from monarch.actor import Actor, HostMesh, ProcMesh, current_rank, endpoint, this_host  # noqa: E402

import psutil  # noqa: E402
import torchstore  # noqa: E402

from forge import metrics, weight_store  # noqa: E402

logger = logging.getLogger(__name__)


class ProcAgent(Actor):
    """One per process of every provisioned mesh: environment set-up, metric hand-off, and a watchdog.

    The watchdog exists because Monarch 0.1.2's host process outlives a controller that dies without
    cleaning up (SIGKILL, OOM kill): when the controller is gone, the first agent to notice kills the
    whole tree under the host process, so a crash leaves no orphans.
    """

    def __init__(self, controller_pid: int, controller_started: float) -> None:
        if not _is_this_host(controller_pid, controller_started):
            return  # on another host the controller's pid means nothing here
        _write_to_the_controllers_console(controller_pid)
        threading.Thread(target=_exit_with_controller, args=(controller_pid,), daemon=True).start()

    @endpoint
    def set_environment(self, shared: dict[str, str], per_rank: list[dict[str, str]]) -> int:
        rank = current_rank().rank
        os.environ.update(shared)
        os.environ.update(per_rank[rank])
        return os.getpid()

    @endpoint
    def drain_metrics(self) -> dict[str, metrics.Partial]:
        return metrics.drain_local()


@dataclass
class MeshFailure:
    """A process or actor failure on a provisioned mesh, as Monarch reported it."""

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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:  # no CUDA runtime at all
        return []


@dataclass
class Provisioner:
    """Allocates proc meshes on this host (or on a configured Monarch host mesh)."""

    host_mesh: HostMesh | None = None
    gpus: list[int] = field(default_factory=_visible_gpus)
    meshes: dict[str, ProvisionedMesh] = field(default_factory=dict)
    fatal_failures: list[MeshFailure] = field(default_factory=list)
    _names: itertools.count = field(default_factory=itertools.count)
    # Names of meshes already stopped: Monarch keeps reporting their deaths for a while.
    _retired: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._free_gpus = list(self.gpus)
        _append_when_writing_to_a_file()
        self._weight_store_started = False
        self._watcher: asyncio.Task | None = None
        self._store_mesh: ProvisionedMesh | None = None
        weight_store.job_id()  # this controller's pid names the job's shared-memory segments
        weight_store.remove_dead_jobs_segments()

    async def start_weight_store(self) -> None:
        """Start torchstore's controller and storage volume (once); keys of the weight store live there."""
        if not self._weight_store_started:
            # The storage volume runs on a mesh of ours, so its output bypasses Monarch's host like every
            # other process's (ProcAgent) and its death is reported like any other mesh's.
            self._store_mesh = await self.get_proc_mesh(1, mesh_name="weight_store")
            await torchstore.initialize(mesh=self._store_mesh.procs)
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
        gpus: list[int] = []
        if with_gpus:
            if procs > len(self._free_gpus):
                raise ValueError(
                    f"mesh {mesh_name or 'anon'!r} asks for {procs} GPUs (with_gpus=True, procs={procs}) but only "
                    f"{len(self._free_gpus)} of {len(self.gpus)} GPUs on this host are free: {self._free_gpus}"
                )
            gpus, self._free_gpus = self._free_gpus[:procs], self._free_gpus[procs:]
        name = f"{mesh_name or 'mesh'}-{next(self._names)}"
        host = self.host_mesh if self.host_mesh is not None else this_host()
        try:
            proc_mesh = host.spawn_procs(per_host={"procs": procs}, name=name)
            agents = proc_mesh.spawn("proc_agent", ProcAgent, os.getpid(), psutil.Process().create_time())
            shared = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(procs),
                "FORGE_JOB_ID": weight_store.job_id(),
            }
            shared.update(env or {})
            per_rank = []
            for rank in range(procs):
                rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(procs)}
                # Each process sees only its own GPU, always as cuda:0.
                rank_env["CUDA_VISIBLE_DEVICES"] = str(gpus[rank]) if gpus else ""
                per_rank.append(rank_env)
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
                gone = [pid for pid in mesh.pids if not _is_alive(pid)]
                if gone:
                    mesh.failed = True
                    self._report(mesh, f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited "
                                       f"(killed or crashed; its actors are lost)")

    def _report(self, mesh: ProvisionedMesh | None, message: str) -> None:
        event = MeshFailure(mesh.name if mesh else "unknown", message)
        if mesh is not None and mesh.on_failure is not None:
            mesh.on_failure(event)
            return
        logger.error("fatal failure on mesh %s: %s", event.mesh_name, message)
        self.fatal_failures.append(event)

    def _on_mesh_failure(self, failure: Any) -> None:
        # Called by Monarch on its own thread; must never raise (that would exit the process).
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
        rss = {"controller": psutil.Process().memory_info().rss}
        for mesh in self.meshes.values():
            for rank, pid in enumerate(mesh.pids):
                with contextlib.suppress(psutil.Error):
                    rss[f"{mesh.name}[{rank}]"] = psutil.Process(pid).memory_info().rss
        return rss

    async def collect_metrics(self) -> list[dict[str, metrics.Partial]]:
        """Every live process's partial metrics since the last call, plus the controller's own."""
        groups = [metrics.drain_local()]
        for mesh in list(self.meshes.values()):
            if mesh.stopped:
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
        if mesh.failed or not all(_is_alive(pid) for pid in mesh.pids):
            # A mesh that lost a process cannot be stopped through Monarch (the requests wait for answers
            # that never come): kill what is left of it.
            _kill_leftovers(mesh.pids)
            self._free_gpus = sorted(self._free_gpus + mesh.gpus)
            self.meshes.pop(mesh.name, None)
            return
        # Let actors finish what they are doing (background tasks, in-flight store requests): a reply sent
        # to an actor that is already gone is a supervision failure in Monarch 0.1.2.
        for actor in mesh.actors:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.teardown.call(), timeout=10)
        try:
            await asyncio.wait_for(mesh.procs.stop(), timeout=timeout)
        except Exception as e:
            logger.debug("stopping mesh %s: %s", mesh.name, e)
            # Only a mesh that did not stop cleanly is killed: killing processes Monarch is still winding
            # down leaves its agent with undeliverable messages, which it treats as fatal.
            _kill_leftovers(mesh.pids)
        self._free_gpus = sorted(self._free_gpus + mesh.gpus)
        self.meshes.pop(mesh.name, None)

    async def shutdown(self) -> None:
        """Stop every mesh this provisioner made (in parallel); leaves no child processes or segments."""
        if self._watcher is not None:
            self._watcher.cancel()
        store_mesh = self._store_mesh
        # The store outlives the actors that use it (generators finish in-flight fetches in teardown).
        await asyncio.gather(*(self.stop_proc_mesh(m) for m in list(self.meshes.values()) if m is not store_mesh))
        if self._weight_store_started:
            self._weight_store_started = False
            if store_mesh is not None and not store_mesh.failed:
                try:
                    await asyncio.wait_for(torchstore.shutdown(), timeout=20)
                except Exception as e:
                    logger.debug("torchstore shutdown: %s", e)
            torchstore.reset_client()
        if store_mesh is not None:
            await self.stop_proc_mesh(store_mesh)
            self._store_mesh = None
        weight_store.remove_job_segments()
        _kill_leftovers(monarch_children())


def _is_this_host(pid: int, started: float) -> bool:
    """Whether the process `pid`, started at `started` (psutil create_time), runs on this host."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1e-3
    except psutil.Error:
        return False


def _append_when_writing_to_a_file() -> None:
    """The controller's stdout/stderr, when a regular file, in append mode: its processes append to the same
    file (`_write_to_the_controllers_console`), and a writer at its own offset would overwrite their lines."""
    import fcntl
    import stat

    for fd in (1, 2):
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            pass


def _write_to_the_controllers_console(controller_pid: int) -> None:
    """Point this process's stdout and stderr at the controller's, bypassing Monarch's host process.

    Monarch 0.1.2's host reads every child's output from a pipe and forwards it through its log sender, whose
    first use can deadlock the host (a re-entrant lock in hyperactor's type-name cache, `Named::typename` for
    nested generic types, taken while the same lock shard is held): every process of the job then stops
    answering and the job hangs. It struck about 1 start in 3 on a 2-core host. Output written here goes
    straight to the controller's terminal, file or pipe instead, so the host never forwards a line.
    """
    import stat

    for fd in (1, 2):
        target = f"/proc/{controller_pid}/fd/{fd}"
        try:
            flags = os.O_WRONLY | (os.O_APPEND if stat.S_ISREG(os.stat(target).st_mode) else 0)
            opened = os.open(target, flags)
        except OSError:  # a socket or a closed descriptor: keep Monarch's pipe
            continue
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(opened, fd)
        os.close(opened)


def _exit_with_controller(controller_pid: int, poll_s: float = 1.0) -> None:
    while psutil.pid_exists(controller_pid):
        time.sleep(poll_s)
    me = psutil.Process()
    host = me.parent()
    tree = [host, *host.children(recursive=True)] if host and "bootstrap_main" in " ".join(host.cmdline()) else [me]
    for proc in tree:
        if proc.pid != me.pid:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    os._exit(1)


def _is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_leftovers(pids: list[int]) -> None:
    """A process that ignored the stop request (or a wedged one) is killed outright."""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
        except psutil.NoSuchProcess:
            pass


def kill_job_processes() -> None:
    """The last resort of a controller that must exit now: kill every Monarch process it started and
    remove its shared-memory segments (safe from any thread)."""
    _kill_leftovers(monarch_children())
    weight_store.remove_job_segments()


def monarch_children() -> list[int]:
    """Pids of this process's descendants that Monarch started (proc meshes, torchstore volumes)."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any("monarch" in part for part in child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


_provisioner: Provisioner | None = None


def get_provisioner() -> Provisioner:
    """The controller's provisioner (created on first use)."""
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner()
        monarch.actor.unhandled_fault_hook = _provisioner._on_mesh_failure
    return _provisioner


async def shutdown() -> None:
    """Stop every actor, service and mesh this controller started."""
    global _provisioner
    if _provisioner is not None:
        await _provisioner.shutdown()
        _provisioner = None
