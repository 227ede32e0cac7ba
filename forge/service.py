"""Services: N replicas of an actor behind one handle, with routing, sessions and self-healing.

    svc = await Generator.options(num_replicas=2).as_service(model=path)
    out = await svc.generate.route(prompt)            # one healthy replica (round-robin by default)
    out, actor = await svc.generate.route_replica(prompt)  # the same, and the replica's actor that answered
    versions = await svc.policy_version.fanout()      # every healthy replica
    by_index = await svc.policy_version.by_replica()  # the same, keyed by replica index
    async with svc.session():                         # stick to one replica (e.g. for a KV cache)
        await svc.generate.route(turn1); await svc.generate.route(turn2)

A replica whose process dies (Monarch reports a supervision failure, from a call or from its own
monitoring) is marked unhealthy at once; calls that were in flight or queued on it are re-issued on a
healthy replica, and it is restarted in the background (a fresh proc mesh, constructor and `setup`).
The caller sees an error only when no replica is left. An exception raised by the endpoint's own code
is the caller's business and is passed through unchanged (re-running it elsewhere could repeat side effects).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from forge.compat import SupervisionError
from forge.provisioned_mesh import MeshFailure, ProvisionedMesh, ShutDownError
from forge.provisioner import DRAIN_WAIT_S, SPAWN_WAIT_S, get_provisioner, spawn_actor

from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402 (after forge.compat)

logger = logging.getLogger(__name__)

Routing = Literal["round_robin", "least_loaded"]
ROUTINGS: tuple[str, ...] = ("round_robin", "least_loaded")


class NoHealthyReplicaError(RuntimeError):
    """Every replica of a service is dead and none is coming back."""


@dataclass
class Replica:
    index: int
    mesh: ProvisionedMesh
    actor: Any
    healthy: bool = True
    in_flight: int = 0
    restarts: int = 0
    last_failure: str = ""
    generation: int = 0  # which spawn of this replica's mesh it is: a failure reported for an older one is stale


_session_replica: contextvars.ContextVar[dict[int, int] | None] = contextvars.ContextVar("forge_session", default=None)


class Service:
    """Controller-side handle of a replicated actor. Attribute access gives a `ServiceEndpoint`."""

    def __init__(self, actor_cls: type, placement: Any, args: tuple, kwargs: dict, *, routing: Routing = "round_robin",
                 max_restarts: int = 3, restart_wait: float = 180.0) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: must be one of {ROUTINGS}")
        self.actor_cls = actor_cls
        self.placement = placement
        self.args, self.kwargs = args, kwargs
        self.routing = routing
        self.max_restarts = max_restarts
        self.restart_wait = restart_wait
        self.replicas: list[Replica] = []
        self._next = itertools.count()
        self._restarting: dict[int, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: contextvars.Context | None = None
        self._changed: asyncio.Condition | None = None
        self._stopped = False

    @classmethod
    async def start(cls, actor_cls: type, placement: Any, args: tuple, kwargs: dict, **options: Any) -> Service:
        service = cls(actor_cls, placement, args, kwargs, **options)
        service._loop = asyncio.get_running_loop()
        service._context = contextvars.copy_context()
        service._changed = asyncio.Condition()
        provisioner = get_provisioner()
        provisioner.refuse_if_closing(f"starting service {service.name!r}")
        provisioner.services.append(service)  # shutdown stops services before their meshes
        try:
            service.replicas = list(await asyncio.gather(*(service._spawn(i) for i in range(placement.num_replicas))))
        except BaseException:
            await service.stop()
            raise
        return service

    @property
    def name(self) -> str:
        return self.placement.mesh_name or self.actor_cls.__name__.lower()

    async def _spawn(self, index: int, generation: int = 0) -> Replica:
        provisioner = get_provisioner()
        mesh = await provisioner.get_proc_mesh(
            self.placement.procs,
            hosts=self.placement.hosts,
            with_gpus=self.placement.with_gpus,
            gpus_per_proc=self.placement.gpus_per_proc,
            mesh_name=f"{self.name}-r{index}",
            role=self.name,  # with a `hosts` config: replicas take the role's hosts in turn
            replica=index,
            on_failure=lambda failure, i=index, g=generation: self._failure_from_monitor(i, g, failure),
        )
        actor = await spawn_actor(self.actor_cls, mesh, self.args, self.kwargs)
        return Replica(index, mesh, actor, generation=generation)

    # --- failure handling -------------------------------------------------------------------------

    def _failure_from_monitor(self, index: int, generation: int, failure: MeshFailure) -> None:
        # Monarch calls this on its own thread.
        if self._loop is not None and not self._stopped:
            # In the service's own context, not the Monarch thread's: the restart this may start spawns on
            # `this_host()`, which Monarch 0.7 looks up in the caller's context (on its thread: no proc mesh).
            self._loop.call_soon_threadsafe(self._mark_unhealthy, index, failure.message, generation,
                                            context=self._context)

    def _mark_unhealthy(self, index: int, reason: str, generation: int) -> None:
        if self._stopped or index >= len(self.replicas):
            return
        replica = self.replicas[index]
        # A replaced mesh's late supervision events (its agent reporting the shutdown of the mesh the restart
        # stopped) concern the old mesh, not the one now serving.
        if not replica.healthy or generation < replica.generation:
            return
        replica.healthy = False
        replica.last_failure = reason
        logger.warning("service %s: replica %d failed: %s", self.name, index, reason.splitlines()[0][:300])
        if replica.restarts < self.max_restarts and index not in self._restarting:
            self._restarting[index] = asyncio.ensure_future(self._restart(index))
        self._notify()

    async def _restart(self, index: int) -> None:
        old = self.replicas[index]
        try:
            await get_provisioner().stop_proc_mesh(old.mesh, timeout=10)
            if self._stopped:
                return
            new = await self._spawn(index, old.generation + 1)
            new.restarts = old.restarts + 1
            if self._stopped:  # stopped while the new replica was starting: it never serves
                await get_provisioner().stop_proc_mesh(new.mesh)
                return
            self.replicas[index] = new
            logger.warning("service %s: replica %d restarted (restart %d)", self.name, index, new.restarts)
        except ShutDownError:
            logger.debug("service %s: replica %d not restarted: shutting down", self.name, index)
        except Exception as e:
            old.restarts = self.max_restarts  # give up on this replica
            old.last_failure = f"{old.last_failure}\nrestart failed: {e!r}"
            logger.error("service %s: replica %d could not be restarted: %r", self.name, index, e)
        finally:
            self._restarting.pop(index, None)
            self._notify()

    def _notify(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        if self._changed is not None and not self._stopped:
            asyncio.ensure_future(notify())

    # --- choosing a replica -----------------------------------------------------------------------

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def _choose(self) -> Replica:
        deadline = time.monotonic() + self.restart_wait
        while True:
            if self._stopped:
                raise ShutDownError(f"service {self.name!r} has been stopped; it takes no new calls")
            healthy = self.healthy_replicas()
            sessions = _session_replica.get()
            if sessions is not None and id(self) in sessions:
                pinned = self.replicas[sessions[id(self)]]
                if pinned.healthy:
                    return pinned
                healthy = healthy  # the pinned replica died: re-pin below
            if healthy:
                if self.routing == "least_loaded":
                    replica = min(healthy, key=lambda r: (r.in_flight, r.index))
                else:
                    replica = healthy[next(self._next) % len(healthy)]
                if sessions is not None and id(self) in sessions:
                    sessions[id(self)] = replica.index
                return replica
            if not self._restarting or time.monotonic() > deadline:
                reasons = "; ".join(f"replica {r.index}: {r.last_failure.splitlines()[0][:200]}" for r in self.replicas)
                raise NoHealthyReplicaError(f"service {self.name}: no healthy replica left ({reasons})")
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)

    async def _call(self, endpoint: str, args: tuple, kwargs: dict, replica: Replica | None = None,
                    answered_by: list[Replica] | None = None) -> Any:
        if self._stopped:
            raise ShutDownError(f"service {self.name!r} has been stopped; it takes no new calls")
        while True:
            target = replica or await self._choose()
            target.in_flight += 1
            try:
                if answered_by is not None:
                    answered_by[:] = [target]
                method = getattr(target.actor, endpoint)
                if self.placement.procs == 1:
                    return await method.call_one(*args, **kwargs)
                # A multi-process replica (e.g. a sharded engine) answers with rank 0's value.
                values = await method.call(*args, **kwargs)
                return next(iter(values.values()))
            except SupervisionError as e:
                self._mark_unhealthy(target.index, str(e), target.generation)
                if replica is not None:
                    raise
            finally:
                target.in_flight -= 1

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Service]:
        """Within the block, every `route` of this service from this task goes to one replica."""
        sessions = dict(_session_replica.get() or {})
        sessions[id(self)] = (await self._choose()).index
        token = _session_replica.set(sessions)
        try:
            yield self
        finally:
            _session_replica.reset(token)

    def __getattr__(self, name: str) -> ServiceEndpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        if not isinstance(getattr(self.actor_cls, name, None), EndpointProperty):
            raise AttributeError(f"{self.actor_cls.__name__} has no endpoint {name!r}")
        return ServiceEndpoint(self, name)

    async def stop(self) -> None:
        """Refuse new calls, let restarts under way finish (their new replica is stopped once spawned:
        one killed mid-spawn could be left running), give calls in flight `DRAIN_WAIT_S`, then stop every replica."""
        if self._stopped:
            return
        self._stopped = True
        restarts = list(self._restarting.values())
        if restarts:
            _, late = await asyncio.wait(restarts, timeout=SPAWN_WAIT_S)
            for task in late:
                task.cancel()
        deadline = time.monotonic() + DRAIN_WAIT_S
        while any(r.in_flight for r in self.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        provisioner = get_provisioner()
        await asyncio.gather(*(provisioner.stop_proc_mesh(r.mesh) for r in self.replicas))
        with contextlib.suppress(ValueError):
            provisioner.services.remove(self)


class ServiceEndpoint:
    def __init__(self, service: Service, name: str) -> None:
        self.service = service
        self.name = name

    async def route(self, *args: Any, **kwargs: Any) -> Any:
        """Call one healthy replica (re-issued elsewhere if that replica dies mid-call)."""
        return await self.service._call(self.name, args, kwargs)

    async def route_replica(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """`route`, and the actor handle of the replica that answered: for a caller that has another actor call that
        replica later (the replay buffer takes the completions a generator keeps, apps.grpo)."""
        answered_by: list[Replica] = []
        value = await self.service._call(self.name, args, kwargs, answered_by=answered_by)
        return value, answered_by[0].actor

    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Call every healthy replica; returns their results in replica order."""
        return list((await self.by_replica(*args, **kwargs)).values())

    async def by_replica(self, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """`fanout` keyed by replica index, for a caller that must say which replica answered what (the weight
        canary names the replica that serves wrong weights). A replica that dies during the call is left out."""
        replicas = self.service.healthy_replicas()
        if not replicas:
            await self.service._choose()  # waits for a restart or raises NoHealthyReplicaError
            replicas = self.service.healthy_replicas()
        results = await asyncio.gather(
            *(self.service._call(self.name, args, kwargs, replica=r) for r in replicas), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, SupervisionError):
                raise result
        return {r.index: result for r, result in zip(replicas, results) if not isinstance(result, BaseException)}
