"""The provisioner: allocates Monarch proc meshes, assigns GPUs, sets the distributed environment, and
stops everything it made.

One provisioner lives in the controller process (`get_provisioner()`). Every proc mesh it spawns gets
a small `ProcAgent` actor on each process that sets that process's environment (CUDA_VISIBLE_DEVICES,
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) before any user actor exists, and that hands the
process's metrics to the controller each step.

Several hosts: `configure_hosts(HostsConfig)` (before anything else starts Monarch) makes the provisioner
place each mesh on the hosts its role has in the config (forge.hosts). Every process is then known by its
host and pid (`ProcessId`); the liveness, memory and killing of another host's processes go through a
small watch mesh on that host, never through this host's process table.
`start_weight_store()` also starts one weight relay per host (forge/weight_relay.py), and every process
of such a job runs its weight store in relayed mode (FORGE_WEIGHT_RELAY).

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
from dataclasses import dataclass, field, is_dataclass
from typing import Any, AsyncIterator, Callable

from forge import compat, metrics, processes, weight_store
from forge.endpoints import ActorHandle, EndpointActor
from forge.hosts import HostsConfig, HostsError
from forge.hosts_mesh import Lifeline, allocate_host_mesh, check_hosts, lifeline_address
from forge.job_auth import SECRET_VARIABLE, job_secret
from forge.proc_agent import ProcAgent
from forge.weight_relay import WeightRelay
from forge.processes import ProcessId, free_port, kill_job_processes, monarch_children  # noqa: F401 (public here too)

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


def _visible_gpus() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:  # no CUDA runtime at all
        return []


# Every proc mesh runs Monarch's log forwarder, an actor mesh Monarch names `logger-<id>`.
MONARCH_LOG_FORWARDER = "logger-"


def actor_mesh_name(proc_mesh: str, actor: str) -> str:
    """The name of an actor mesh forge spawns on a proc mesh: Monarch reports a failure by that name."""
    return f"{proc_mesh}_{actor}"


HOST_SILENT_POLLS = 10  # a host whose watch agent misses this many polls in a row (~10 s) is reported lost
REMOTE_SPAWN_TIMEOUT_S = 120.0  # a proc mesh on other hosts not up by then is an error naming it
SPAWN_WAIT_S = 120.0  # how long shutdown waits for spawns already under way (a loaded host is slow)
DRAIN_WAIT_S = 10.0  # how long shutdown lets calls in flight finish before stopping their processes


@dataclass
class Provisioner:
    """Allocates proc meshes on this host (or on a configured Monarch host mesh) and stops them all."""

    host_mesh: HostMesh | None = None
    hosts: HostsConfig | None = None  # the hosts `host_mesh` spans, and where each role goes
    gpus: list[int] = field(default_factory=_visible_gpus)
    meshes: dict[str, ProvisionedMesh] = field(default_factory=dict)
    fatal_failures: list[MeshFailure] = field(default_factory=list)
    services: list[Any] = field(default_factory=list)  # stopped first at shutdown
    _names: itertools.count = field(default_factory=itertools.count)
    # Names of meshes already stopped: Monarch keeps reporting their deaths for a while.
    _retired: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        compat.configure_job_environment()
        self._free_gpus = list(self.gpus)
        self._closing = False
        self._busy: set[asyncio.Future] = set()  # spawns (and actor set-ups) under way
        self._weight_store_started = False
        self._watcher: asyncio.Task | None = None
        self._store_mesh: ProvisionedMesh | None = None
        self.relays: list[Any] = []  # one WeightRelay per host of a multi-host job (forge/weight_relay.py)
        self._host_watch: dict[int, ProvisionedMesh] = {}  # host index -> its watch mesh (other hosts only)
        self._silent_polls: dict[int, int] = {}
        self._watch_lock = asyncio.Lock()
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
        """Start torchstore's controller and storage volume (once); keys of the weight store live there."""
        if not self._weight_store_started:
            # The storage volume runs on a mesh of ours, so its output bypasses Monarch's host like every
            # other process's (ProcAgent) and its death is reported like any other mesh's.
            self._store_mesh = await self.get_proc_mesh(1, mesh_name="weight_store")
            await compat.initialize_torchstore(self._store_mesh.procs)
            self._weight_store_started = True
            if self.hosts is not None:  # each version crosses to a host once, whatever reads it there
                await asyncio.gather(*(self._start_relay(index) for index in range(self.hosts.count)))

    async def _start_relay(self, index: int) -> None:
        """Host `index`'s weight relay (forge/weight_relay.py), in a 1-process mesh of its own on that host."""
        name = f"weight_relay{index}-{next(self._names)}"
        async with self.busy(f"spawning mesh {name!r}"):
            mesh = await asyncio.shield(self._spawn(name, 1, 0, None, None, [index]))
            await asyncio.shield(self._watch_host(index))
        self.refuse_if_closing(f"spawning mesh {name!r}")
        self.relays.append(await spawn_actor(WeightRelay, mesh))

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
            placement = self._place(role or mesh_name or "mesh", hosts or 1, replica, procs)
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

    def _place(self, role: str, span: int, replica: int, procs: int) -> list[int]:
        """The indices of the `span` consecutive hosts (in the host mesh) this mesh goes on."""
        assert self.hosts is not None
        candidates = self.hosts.hosts_of(role)
        where = f"hosts.roles.{role}={candidates}" if role in self.hosts.roles else f"role {role!r} (not in hosts.roles: host 0)"
        if span > len(candidates):
            raise HostsError(f"{where}: a mesh of {span} hosts needs at least {span} hosts for its role")
        start = (replica * span) % len(candidates)
        chosen = sorted(candidates[(start + k) % len(candidates)] for k in range(span))
        if chosen != list(range(chosen[0], chosen[0] + span)):
            raise HostsError(f"{where}: a mesh spanning {span} hosts needs consecutive host indices, got {chosen}")
        used: dict[int, int] = {}
        for mesh in self.meshes.values():
            for host in mesh.hosts:
                used[host] = used.get(host, 0) + len(mesh.processes) // len(mesh.hosts)
        for host in chosen:
            self.hosts.check_capacity(used, host, procs, f"mesh {role!r}")
        return chosen

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
                                     psutil.Process().create_time(), weight_store.job_id(), name)
            found = sorted((await agents.identify.call()).values(), key=lambda p: p["rank"])
            master = found[0]
            shared = {
                "MASTER_ADDR": master["address"],
                "MASTER_PORT": str(master["free_port"]),
                "WORLD_SIZE": str(len(found)),
                "FORGE_JOB_ID": weight_store.job_id(),
                **({weight_store.RELAY_VARIABLE: "1"} if self.hosts is not None else {}),
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
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_processes())
        logger.debug("provisioned mesh %s: %d procs (%s), gpus %s", name, len(ids), ", ".join(map(str, ids)), gpus)
        if not mesh.local:
            logger.info("mesh %s: output of its processes on other hosts in %s", name,
                        ", ".join(f"{p.host}:{f}" for p, f in zip(ids, mesh.log_files) if f))
        return mesh

    async def _watch_host(self, index: int) -> None:
        """A 1-process mesh on host `index` whose agent answers for that host's processes (once per host)."""
        async with self._watch_lock:  # replicas spawned together on one host share its watch mesh
            if index in self._host_watch or self.hosts is None:
                return
            name = f"host{index}-watch"
            self._host_watch[index] = await self._spawn(name, 1, False, None, None, [index])
            # Nothing of the job outlives a SIGKILLed controller on that host (forge.compat, 22).
            await spawn_actor(Lifeline, self._host_watch[index], lifeline_address())
            self.meshes.pop(name, None)  # watched through its own answers, not counted as a role

    async def _watch_processes(self, poll_s: float = 0.5) -> None:
        """Report a mesh whose process has exited within a second. Monarch notices a dead process only when
        its proc-state queries go unanswered for HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE (300 s here, so that
        busy processes on a loaded host are not declared dead): far too late for a job to fail fast.
        Processes of this host are read from its process table; another host's from its watch agent."""
        while self.meshes:
            await asyncio.sleep(poll_s)
            live = [m for m in self.meshes.values() if not (m.stopped or m.failed)]
            remote: dict[int, list[ProcessId]] = {}
            for mesh in live:
                for host, proc in zip(self._host_of_rank(mesh), mesh.processes):
                    if not proc.local:
                        remote.setdefault(host, []).append(proc)
            answers = await asyncio.gather(*(self._dead_on_host(host, procs) for host, procs in remote.items()))
            dead = {proc for procs in answers for proc in procs}
            for mesh in live:
                gone = [p for p in mesh.processes if (not processes.is_alive(p.pid) if p.local else p in dead)]
                if gone and not mesh.failed:
                    self._report_gone(mesh, gone)

    def _host_of_rank(self, mesh: ProvisionedMesh) -> list[int]:
        """The host index of each rank of `mesh` (ranks run host by host); -1 on the controller's host."""
        per_host = len(mesh.processes) // max(1, len(mesh.hosts))
        return [mesh.hosts[rank // per_host] if mesh.hosts else -1 for rank in range(len(mesh.processes))]

    def _report_gone(self, mesh: ProvisionedMesh, gone: list[ProcessId]) -> None:
        mesh.failed = True
        if mesh.reported:  # Monarch's supervision said it first
            return
        lost = [f"host {i} ({self.hosts.describe(i)})" for i in mesh.hosts
                if self.hosts is not None and i in self._host_watch and self._host_watch[i].failed]
        why = f"{' and '.join(lost)} stopped answering (its agent or the machine is gone)" if lost else \
            "killed or crashed"
        self._report(mesh, f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited ({why}; its actors "
                           "are lost)")

    async def _dead_on_host(self, host: int, procs: list[ProcessId]) -> list[ProcessId]:
        """Which of `procs` (all on host `host`) have exited, as that host's watch agent sees it. A host whose
        agent stops answering is lost, and every process of the job there with it."""
        watch = self._host_watch.get(host)
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

    def _report(self, mesh: ProvisionedMesh | None, message: str) -> None:
        event = MeshFailure(mesh.name if mesh else "unknown", message)
        if mesh is not None:
            mesh.reported = True
        if mesh is not None and mesh.on_failure is not None:
            mesh.on_failure(event)
            return
        if self._closing:
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
            if any(source.startswith(f"{name}_") for name in self._retired):
                return
            mesh = next((m for m in self.meshes.values() if source.startswith(f"{m.name}_")), None)
            if mesh is not None and mesh.stopped:
                return
            self._report(mesh, self._with_gone_processes(mesh, str(failure)))
        except Exception:  # pragma: no cover - defensive
            logger.exception("error while handling a mesh failure")

    @staticmethod
    def _with_gone_processes(mesh: ProvisionedMesh | None, message: str) -> str:
        """Monarch's report, naming the processes of this host that are gone (Monarch 0.7 names neither them nor
        their pids, and its report usually beats the pid watcher's)."""
        gone = [p for p in (mesh.processes if mesh else []) if p.local and not processes.is_alive(p.pid)]
        if not gone:
            return message
        return f"process {', '.join(map(str, gone))} of mesh {mesh.name!r} exited ({message})"

    async def wait_for_fatal_failure(self) -> MeshFailure:
        """Returns when any mesh not owned by a service fails (apps race their main loop against it)."""
        while not self.fatal_failures:
            # The hook runs on a Monarch thread, where an asyncio primitive must not be touched: poll.
            await asyncio.sleep(0.2)
        return self.fatal_failures[0]

    def memory_rss(self) -> dict[str, int]:
        """Resident memory in bytes of the controller and of every live process of every mesh on this host, by
        name (another host's processes are not in this host's process table: `remote_memory_rss`)."""
        return processes.resident_memory({f"{mesh.name}[{rank}]": proc.pid for mesh in self.meshes.values()
                                          for rank, proc in enumerate(mesh.processes) if proc.local})

    async def remote_memory_rss(self) -> dict[str, int]:
        """Resident memory in bytes of every live process of every mesh on the other hosts, as their watch
        agents read it."""
        rss: dict[str, int] = {}
        for host, watch in self._host_watch.items():
            named = {f"{mesh.name}[{rank}]": proc.pid for mesh in self.meshes.values()
                     for rank, (h, proc) in enumerate(zip(self._host_of_rank(mesh), mesh.processes))
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
        self._retired.add(mesh.name)
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
        for host, proc in zip(self._host_of_rank(mesh), mesh.processes):
            if not proc.local:
                by_host.setdefault(host, []).append(proc.pid)
        for host, pids in by_host.items():
            watch = self._host_watch.get(host)
            if watch is not None and watch is not mesh and not watch.failed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.agents.kill.call_one(pids), timeout=10)

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
        await asyncio.gather(*(self.stop_proc_mesh(watch) for watch in self._host_watch.values()))
        self._host_watch.clear()
        if self.hosts is not None and self.host_mesh is not None:
            try:  # the host processes of the allocation: Monarch stops the procs they run
                await asyncio.wait_for(self.host_mesh.shutdown(), timeout=30)
            except Exception as e:
                logger.warning("stopping the host mesh: %r", e)
        kill_job_processes()


_provisioner: Provisioner | None = None
_shutting_down: asyncio.Future | None = None
_hosts: HostsConfig | None = None


def configure_hosts(hosts: HostsConfig | None) -> None:
    """Place the job's meshes on `hosts` (None or an empty section: this host only). Call it before anything
    starts Monarch: the section is checked (fields, reachable agents) and the transport switched to tcp here,
    and a bad section raises `HostsError` naming the field."""
    global _hosts
    if _provisioner is not None and _provisioner.meshes:
        raise HostsError("hosts: configure the hosts before the first actor or service is started")
    if hosts is not None and hosts.enabled:
        check_hosts(hosts)
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
