"""The provisioner: allocates Monarch proc meshes, assigns GPUs, sets the distributed environment, and
stops everything it made.

One provisioner lives in the controller process (`get_provisioner()`). Every proc mesh it spawns gets
a small `ProcAgent` actor on each process that sets that process's environment (CUDA_VISIBLE_DEVICES,
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) before any user actor exists, and that hands the
process's metrics to the controller each step.

Several hosts: `configure_hosts(HostsConfig)` (before anything else starts Monarch) makes the provisioner
place each mesh on the hosts its role has in the config (forge.hosts.config). Every process is then known by its
host and pid (`ProcessId`); the liveness, memory and killing of another host's processes go through a
small watch mesh on that host, never through this host's process table.
Every process of such a job knows it spans hosts (FORGE_MULTI_HOST, forge/job.py).

Planes built on the runtime (the weight plane, forge/weights/) are not imported here: they start their own meshes
through it (`spawn_on_host`, `get_proc_mesh`), ask for a mesh to be stopped after every other one (`stop_last`), and
register the clean-up of what they leave on a host with forge/job.py, which the provisioner runs when the job ends.

Failures: Monarch's default reaction to a dead process is to exit the controller. The provisioner
replaces that hook with its `failures` (forge/failure_watch.py), which also polls the processes: a failure on
a mesh that a service owns goes to the service (which re-routes and restarts the replica); any other is fatal.
Placement on hosts and GPUs: forge/placement.py; what a mesh is: forge/provisioned_mesh.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import os
import warnings
from dataclasses import dataclass, field, is_dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from forge import compat, job, metrics, processes
from forge.endpoints import ActorHandle, EndpointActor
from forge.failure_watch import FailureWatch
from forge.hosts.config import HostsConfig, HostsError
from forge.hosts.host_mesh import (Lifeline, allocate_host_mesh, allocate_slurm, check_hosts, lifeline_address,
                                   release_slurm)
from forge.job_auth import SECRET_VARIABLE, job_secret
from forge.proc_agent import ProcAgent
from forge.placement import place, visible_gpus
from forge.provisioned_mesh import MeshFailure, ProvisionedMesh, ShutDownError, actor_mesh_name
from forge.processes import ProcessId, free_port, kill_job_processes  # noqa: F401 (free_port: public here too)

import psutil  # noqa: E402
from monarch.actor import HostMesh, this_host  # noqa: E402

logger = logging.getLogger(__name__)


REMOTE_SPAWN_TIMEOUT_S = 120.0  # a proc mesh on other hosts not up by then is an error naming it
SPAWN_WAIT_S = 120.0  # how long shutdown waits for spawns already under way (a loaded host is slow)
DRAIN_WAIT_S = 10.0  # how long shutdown lets calls in flight finish before stopping their processes


@dataclass
class Provisioner:
    """Allocates proc meshes on this host (or on a configured Monarch host mesh) and stops them all."""

    host_mesh: HostMesh | None = None
    hosts: HostsConfig | None = None  # the hosts `host_mesh` spans, and where each role goes
    gpus: list[int] = field(default_factory=visible_gpus)
    meshes: dict[str, ProvisionedMesh] = field(default_factory=dict)
    services: list[Any] = field(default_factory=list)  # stopped first at shutdown
    _names: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        compat.configure_job_environment()
        self._free_gpus = list(self.gpus)
        self._closing = False
        self._busy: set[asyncio.Future] = set()  # spawns (and actor set-ups) under way
        # Meshes stopped after every other one (a store the others use), each after its hook: (mesh, hook).
        self._last: list[tuple[ProvisionedMesh, Callable[[ProvisionedMesh], Awaitable[None]] | None]] = []
        self.planes: dict[str, Any] = {}  # state of the planes started on this provisioner (forge/weights/startup.py)
        self.failures = FailureWatch(self.meshes, self.hosts)
        self._watch_lock = asyncio.Lock()
        # This controller's pid names the job; dead jobs' leftovers go now, this one's at exit at the latest.
        job.start()

    @property
    def closing(self) -> bool:
        return self._closing

    def refuse_if_closing(self, what: str) -> None:
        if self._closing:
            raise ShutDownError(f"{what}: the job is shutting down; nothing new is started")

    @contextlib.asynccontextmanager
    async def busy(self, what: str) -> AsyncIterator[None]:
        """Marks work (a spawn, an actor's set-up) that shutdown must let finish before it stops processes: a mesh
        still being spawned is not yet in `meshes`, and would be left running."""
        self.refuse_if_closing(what)
        done = asyncio.get_running_loop().create_future()
        self._busy.add(done)
        try:
            yield
        finally:
            self._busy.discard(done)
            done.set_result(None)

    async def start_weight_store(self) -> None:
        """Deprecated: `await forge.weights.start_weight_store()`; the runtime does not start the weight plane."""
        warnings.warn("Provisioner.start_weight_store() is deprecated: use `await forge.weights.start_weight_store()`",
                      DeprecationWarning, stacklevel=2)
        start = importlib.import_module("forge.weights.startup").start_weight_store  # the one reference, by name
        await start(self)

    async def spawn_on_host(self, index: int, name: str) -> ProvisionedMesh:
        """A 1-process mesh of its own on host `index` of the job's hosts, watched like every other one."""
        name = f"{name}-{next(self._names)}"
        async with self.busy(f"spawning mesh {name!r}"):
            mesh = await asyncio.shield(self._spawn(name, 1, 0, None, None, [index]))
            await asyncio.shield(self._watch_host(index))
        self.refuse_if_closing(f"spawning mesh {name!r}")
        return mesh

    def stop_last(self, mesh: ProvisionedMesh, before: Callable[[ProvisionedMesh], Awaitable[None]] | None = None
                  ) -> None:
        """Stop `mesh` at shutdown only after every other mesh (a store the others use until they stop), awaiting
        `before(mesh)` first (bounded by the caller)."""
        self._last.append((mesh, before))

    async def get_proc_mesh(
        self,
        procs: int = 1,
        *,
        hosts: int | None = None,
        with_gpus: bool = False,
        gpus_per_proc: int = 1,
        mesh_name: str | None = None,
        env: dict[str, str] | None = None,
        on_failure: Callable[[MeshFailure], None] | None = None,
        role: str | None = None,
        replica: int = 0,
    ) -> ProvisionedMesh:
        """Spawn `procs` processes (per host) with their environment set; fails before spawning on bad requests.
        With a `hosts` config, the mesh goes on `hosts` (default 1) of the hosts of `role` (default: the mesh
        name), replica `replica` of a service on the next ones in turn."""
        if procs < 1:
            raise ValueError(f"procs={procs}: must be >= 1")
        placement: list[int] = []
        if self.hosts is not None:
            placement = place(self.hosts, self.meshes.values(), role or mesh_name or "mesh", hosts or 1, replica, procs)
        elif hosts not in (None, 1):
            if self.host_mesh is None:
                raise ValueError(
                    f"hosts={hosts}: more than one host needs a Monarch host mesh; "
                    "create the Provisioner with host_mesh=monarch.actor.hosts_from_config(...)"
                )
            if hosts > len(self.host_mesh.region.slice()):
                raise ValueError(f"hosts={hosts}: the configured host mesh has {len(self.host_mesh.region.slice())} hosts")
        if with_gpus and procs * gpus_per_proc > len(self._free_gpus):
            raise ValueError(
                f"mesh {mesh_name or 'anon'!r} asks for {procs * gpus_per_proc} GPUs (with_gpus=True, procs={procs}, "
                f"gpus_per_proc={gpus_per_proc}) but only {len(self._free_gpus)} of {len(self.gpus)} GPUs on this "
                f"host are free: {self._free_gpus}"
            )
        name = f"{mesh_name or 'mesh'}-{next(self._names)}"
        async with self.busy(f"spawning mesh {name!r}"):
            # Shielded: a caller that is cancelled (a service stopping a restart) does not abort Monarch's
            # spawn half-way; the mesh is registered anyway, and shutdown stops it.
            mesh = await asyncio.shield(self._spawn(name, procs, gpus_per_proc if with_gpus else 0, env, on_failure,
                                                    placement))
            if not mesh.local:
                for index in placement:
                    await asyncio.shield(self._watch_host(index))
        self.refuse_if_closing(f"spawning mesh {name!r}")  # shutdown began meanwhile: it stops this mesh
        return mesh

    async def _spawn(self, name: str, procs: int, gpus_per_proc: int, env: dict[str, str] | None,
                     on_failure: Callable[[MeshFailure], None] | None, placement: list[int]) -> ProvisionedMesh:
        gpus = self._free_gpus[: procs * gpus_per_proc]
        self._free_gpus = self._free_gpus[procs * gpus_per_proc :]
        if placement:
            host = self.host_mesh.slice(hosts=slice(placement[0], placement[-1] + 1))
        else:
            host = self.host_mesh if self.host_mesh is not None else this_host()
        try:
            proc_mesh = host.spawn_procs(per_host={"procs": procs}, name=name)
            if placement:
                # On other hosts a mesh that never comes up would block the first spawn on it for ever.
                await asyncio.wait_for(proc_mesh.initialized, timeout=REMOTE_SPAWN_TIMEOUT_S)
            agents = proc_mesh.spawn(actor_mesh_name(name, "proc_agent"), ProcAgent, os.getpid(),
                                     psutil.Process().create_time(), job.job_id(), name)
            found = sorted((await agents.identify.call()).values(), key=lambda p: p["rank"])
            master = found[0]
            shared = {
                "MASTER_ADDR": master["address"],
                "MASTER_PORT": str(master["free_port"]),
                "WORLD_SIZE": str(len(found)),
                job.JOB_VARIABLE: job.job_id(),
                **({job.MULTI_HOST_VARIABLE: "1"} if self.hosts is not None else {}),
                # A process on another host inherits its worker's environment, not this one's: the job's secret
                # (forge.job_auth) reaches it here.
                **({SECRET_VARIABLE: job_secret().decode()} if placement else {}),
                **(env or {}),
            }
            # Ranks run host by host, `procs` on each. Each process sees only its own GPUs, from cuda:0 on.
            def visible(local_rank: int) -> str:
                return ",".join(map(str, gpus[local_rank * gpus_per_proc : (local_rank + 1) * gpus_per_proc]))

            per_rank = [{"RANK": str(rank), "LOCAL_RANK": str(rank % procs), "LOCAL_WORLD_SIZE": str(procs),
                         "CUDA_VISIBLE_DEVICES": visible(rank % procs)} for rank in range(len(found))]
            await agents.set_environment.call(shared, per_rank)
        except BaseException:
            self._free_gpus = sorted(self._free_gpus + gpus)
            raise
        ids = [ProcessId(p["host"], p["pid"], p["local"]) for p in found]
        mesh = ProvisionedMesh(name, proc_mesh, agents, gpus, ids, on_failure, hosts=placement,
                               log_files=[p["log_file"] for p in found])
        self.meshes[name] = mesh
        self.failures.watch_processes()
        logger.debug("provisioned mesh %s: %d procs (%s), gpus %s", name, len(ids), ", ".join(map(str, ids)), gpus)
        if not mesh.local:
            logger.info("mesh %s: output of its processes on other hosts in %s", name,
                        ", ".join(f"{p.host}:{f}" for p, f in zip(ids, mesh.log_files) if f))
        return mesh

    async def _watch_host(self, index: int) -> None:
        """A 1-process mesh on host `index` whose agent answers for that host's processes (once per host)."""
        async with self._watch_lock:  # replicas spawned together on one host share its watch mesh
            if index in self.failures.host_watch or self.hosts is None:
                return
            name = f"host{index}-watch"
            self.failures.host_watch[index] = await self._spawn(name, 1, False, None, None, [index])
            # Nothing of the job outlives a SIGKILLed controller on that host (forge.compat, 22).
            await spawn_actor(Lifeline, self.failures.host_watch[index], lifeline_address())
            self.meshes.pop(name, None)  # watched through its own answers, not counted as a role

    def memory_rss(self) -> dict[str, int]:
        """Resident memory in bytes of the controller and of every live process of every mesh on this host, by
        name (another host's processes are not in this host's process table: `remote_memory_rss`)."""
        return processes.resident_memory({f"{mesh.name}[{rank}]": proc.pid for mesh in self.meshes.values()
                                          for rank, proc in enumerate(mesh.processes) if proc.local})

    async def remote_memory_rss(self) -> dict[str, int]:
        """Resident memory in bytes of every live process of every mesh on the other hosts, as their watch
        agents read it."""
        rss: dict[str, int] = {}
        for host, watch in self.failures.host_watch.items():
            named = {f"{mesh.name}[{rank}]": proc.pid for mesh in self.meshes.values()
                     for rank, (h, proc) in enumerate(zip(mesh.host_of_rank(), mesh.processes))
                     if h == host and not proc.local}
            with contextlib.suppress(Exception):
                answer = await asyncio.wait_for(watch.agents.resident_memory.call_one(named), timeout=10)
                rss.update({k: v for k, v in answer.items() if k != "controller"})
        return rss

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
        self.failures.retired.add(mesh.name)
        if mesh.failed or not all(processes.is_alive(p.pid) for p in mesh.processes if p.local):
            # A mesh that lost a process cannot be stopped through Monarch (the requests wait for answers
            # that never come): kill what is left of it.
            await self._kill(mesh)
        else:
            # Let actors finish what they are doing (background tasks, in-flight store requests): a reply
            # sent to an actor that is already gone is a supervision failure (forge.compat, 8).
            for actor in mesh.actors:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(actor.teardown.call(), timeout=10)
            try:
                await asyncio.wait_for(mesh.procs.stop(), timeout=timeout)
            except Exception as e:
                # A mesh that did not stop cleanly is killed.
                logger.debug("stopping mesh %s: %s", mesh.name, e)
                await self._kill(mesh)
        self._free_gpus = sorted(self._free_gpus + mesh.gpus)
        self.meshes.pop(mesh.name, None)

    async def _kill(self, mesh: ProvisionedMesh) -> None:
        """Kill a mesh's processes: this host's directly, another host's through its watch agent (bounded)."""
        processes.kill(processes.local_pids(mesh.processes))
        by_host: dict[int, list[int]] = {}
        for host, proc in zip(mesh.host_of_rank(), mesh.processes):
            if not proc.local:
                by_host.setdefault(host, []).append(proc.pid)
        for host, pids in by_host.items():
            watch = self.failures.host_watch.get(host)
            if watch is not None and watch is not mesh and not watch.failed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.agents.kill.call_one(pids), timeout=10)

    async def shutdown(self) -> None:
        """Stop everything this provisioner made, in order: services (their restarts, then their calls in
        flight, bounded), spawns under way (let finish), every mesh (in parallel), the meshes asked to stop last
        (the weight store), and what the job left on its hosts (forge/job.py's clean-ups). Leaves no child process and no segment; a second call does nothing."""
        if self._closing:
            return
        self._closing = True
        self.failures.closing = True
        await asyncio.gather(*(service.stop() for service in list(self.services)), return_exceptions=True)
        if self._busy:
            logger.info("shutdown: waiting for %d spawn(s) under way", len(self._busy))
            await asyncio.wait(list(self._busy), timeout=SPAWN_WAIT_S)
        self.failures.stop()
        last, self._last = self._last, []
        # A store outlives the actors that use it (generators finish in-flight fetches in teardown).
        await asyncio.gather(*(self.stop_proc_mesh(m) for m in list(self.meshes.values())
                               if all(m is not mesh for mesh, _ in last)))
        for mesh, before in last:
            if before is not None:
                try:
                    await before(mesh)
                except Exception as e:
                    logger.debug("before stopping %s: %r", mesh.name, e)
            await self.stop_proc_mesh(mesh)
        await asyncio.gather(*(self.stop_proc_mesh(watch) for watch in self.failures.host_watch.values()))
        self.failures.host_watch.clear()
        if self.hosts is not None and self.host_mesh is not None:
            try:  # the host processes of the allocation: Monarch stops the procs they run
                await asyncio.wait_for(self.host_mesh.shutdown(), timeout=30)
            except Exception as e:
                logger.warning("stopping the host mesh: %r", e)
        release_slurm()  # a `hosts.slurm` job's allocation ends here (forge/hosts/slurm.py)
        kill_job_processes()


_provisioner: Provisioner | None = None
_shutting_down: asyncio.Future | None = None
_hosts: HostsConfig | None = None


def configure_hosts(hosts: HostsConfig | None) -> None:
    """Place the job's meshes on `hosts` (None or an empty section: this host only). Call it before anything
    starts Monarch: the section is checked (fields, reachable agents) and the transport switched to tcp here,
    and a bad section raises `HostsError` naming the field. A `hosts.slurm` section is checked (SLURM's commands,
    the partition) before anything is submitted, then its job submitted and waited for (at most its
    `start_timeout_s`) here: its nodes are the job's hosts."""
    global _hosts
    if _provisioner is not None and _provisioner.meshes:
        raise HostsError("hosts: configure the hosts before the first actor or service is started")
    if hosts is not None and hosts.enabled:
        check_hosts(hosts)
        if hosts.slurm.enabled:
            hosts = allocate_slurm(hosts)
        _hosts = hosts
    else:
        _hosts = None


def get_provisioner() -> Provisioner:
    """The controller's provisioner (created on first use, or after a shutdown), on the configured hosts."""
    global _provisioner
    if _provisioner is None:
        if _hosts is not None:

            _provisioner = Provisioner(host_mesh=allocate_host_mesh(_hosts), hosts=_hosts)
        else:
            _provisioner = Provisioner()
        compat.install_fault_hook(_provisioner.failures.on_supervision_event)
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


# --- actors on meshes ------------------------------------------------------------------------------------
# Actor handles are Monarch objects; remember each one's mesh here (holding the handle keeps its id unique).
_MESH_OF: dict[int, tuple[Any, ProvisionedMesh]] = {}


def _plain(value: Any) -> Any:
    """Config sections (OmegaConf nodes, dataclasses) become plain picklable values."""
    if is_dataclass(value) and not isinstance(value, type):
        return value
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return value


async def spawn_actor(cls: type[EndpointActor], mesh: ProvisionedMesh, args: tuple = (), kwargs: dict | None = None
                      ) -> ActorHandle:
    """Spawn `cls` on every process of `mesh` and run its `setup` endpoint; the mesh is stopped if that fails."""
    provisioner = get_provisioner()
    args = tuple(_plain(a) for a in args)
    kwargs = {k: _plain(v) for k, v in (kwargs or {}).items()}
    try:
        # Shutdown lets a set-up under way finish before it stops the mesh, so no mesh spawned meanwhile is left.
        async with provisioner.busy(f"spawning {cls.__name__} on mesh {mesh.name!r}"):
            name = actor_mesh_name(mesh.name, cls.__name__.lower())
            actor = ActorHandle(mesh.procs.spawn(name, cls, *args, **kwargs))
            if cls.has_teardown():
                mesh.actors.append(actor)  # only actors with background work get a teardown call
            await actor.setup.call()
        # A shutdown that began during the set-up stops this mesh once the set-up is done: no handle to hand out.
        provisioner.refuse_if_closing(f"spawning {cls.__name__} on mesh {mesh.name!r}")
    except BaseException:
        await provisioner.stop_proc_mesh(mesh)
        raise
    _MESH_OF[id(actor)] = (actor, mesh)
    return actor


def mesh_of(actor: Any) -> ProvisionedMesh | None:
    """The proc mesh an actor spawned by `spawn_actor` runs on."""
    entry = _MESH_OF.get(id(actor))
    return entry[1] if entry else None


async def stop_actor(actor: Any) -> None:
    """Stop an actor spawned by `spawn_actor` and its processes."""
    entry = _MESH_OF.pop(id(actor), None)
    if entry is not None:
        await get_provisioner().stop_proc_mesh(entry[1])
