"""`ForgeActor`: a Monarch `Actor` that knows how to place itself.

    class Counter(ForgeActor):
        def __init__(self, start: int = 0):
            self.value = start

        @endpoint
        async def increment(self) -> int:
            self.value += 1
            return self.value

    counter = await Counter.options(procs=1).as_actor(start=5)      # an actor mesh
    service = await Counter.options(num_replicas=2).as_service(5)   # replicas behind a Service
    await counter.increment.call_one()
    await service.increment.route()

Construction arguments may come straight from a config section (`as_actor(**cfg.counter)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from forge.compat import EndpointError, raise_if_failed
from forge.endpoints import ActorHandle, EndpointActor, rank0
from forge.provisioner import get_provisioner, mesh_of, spawn_actor, stop_actor
from forge.service import Service

from monarch.actor import endpoint  # noqa: E402 (after forge.compat)

T = TypeVar("T", bound="ForgeActor")


@dataclass(frozen=True)
class Placement:
    """Where and how many: set with `ForgeActor.options(...)`."""

    procs: int = 1
    hosts: int | None = None
    with_gpus: bool = False
    num_replicas: int = 1
    mesh_name: str | None = None
    routing: str = "round_robin"  # services only: "round_robin" or "least_loaded"
    gpus_per_proc: int = 1  # with_gpus: GPUs each process sees (a tensor-parallel vLLM engine in one process)

    def __post_init__(self) -> None:
        if self.procs < 1:
            raise ValueError(f"procs={self.procs}: must be >= 1")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas}: must be >= 1")
        if self.hosts is not None and self.hosts < 1:
            raise ValueError(f"hosts={self.hosts}: must be >= 1 (or None for this host)")
        if self.gpus_per_proc < 1:
            raise ValueError(f"gpus_per_proc={self.gpus_per_proc}: must be >= 1")
        if self.routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"routing={self.routing!r}: must be 'round_robin' or 'least_loaded'")


class ForgeActor(EndpointActor):
    """Base class of forge's actors that place themselves. Subclasses add `@endpoint` methods and may override
    `setup` / `teardown` (forge.endpoints.EndpointActor: endpoints serve concurrently, and their exceptions reach
    callers as `EndpointError` with the remote traceback through the handles `as_actor` and `as_service` return).
    """

    placement: Placement = Placement()

    @classmethod
    def options(
        cls: type[T],
        *,
        procs: int = 1,
        hosts: int | None = None,
        with_gpus: bool = False,
        num_replicas: int = 1,
        mesh_name: str | None = None,
        routing: str = "round_robin",
        gpus_per_proc: int = 1,
    ) -> type[T]:
        """A copy of this class with its placement set; spawn it with `as_actor` or `as_service`."""
        placement = Placement(procs, hosts, with_gpus, num_replicas, mesh_name, routing, gpus_per_proc)
        # Same module and qualname: spawned processes unpickle the original class; the placement
        # only matters here in the controller.
        return type(cls.__name__, (cls,), {"placement": placement, "__qualname__": cls.__qualname__, "__module__": cls.__module__})

    @classmethod
    async def as_actor(cls: type[T], *args: Any, **kwargs: Any) -> T:
        """Spawn one actor mesh of `placement.procs` processes and run its `setup` endpoint."""
        mesh = await get_provisioner().get_proc_mesh(
            cls.placement.procs,
            hosts=cls.placement.hosts,
            with_gpus=cls.placement.with_gpus,
            gpus_per_proc=cls.placement.gpus_per_proc,
            mesh_name=cls.placement.mesh_name or cls.__name__.lower(),
        )
        return await spawn_actor(cls, mesh, args, kwargs)  # type: ignore[return-value]

    @classmethod
    async def as_service(cls, *args: Any, **kwargs: Any) -> Service:
        """Spawn `placement.num_replicas` replicas (each its own proc mesh) behind a `Service`."""
        return await Service.start(cls, cls.placement, args, kwargs, routing=cls.placement.routing)

    @staticmethod
    async def shutdown(actor: Any) -> None:
        """Stop an actor mesh made by `as_actor` and its processes."""
        await stop_actor(actor)


__all__ = ["ActorHandle", "EndpointError", "ForgeActor", "Placement", "endpoint", "mesh_of", "raise_if_failed",
           "rank0"]
