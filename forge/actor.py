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

from dataclasses import dataclass, is_dataclass
from typing import Any, TypeVar

import forge.native

forge.native.setup()

from monarch.actor import Actor, endpoint  # noqa: E402

from forge.provisioner import ProvisionedMesh, get_provisioner  # noqa: E402

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

    def __post_init__(self) -> None:
        if self.procs < 1:
            raise ValueError(f"procs={self.procs}: must be >= 1")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas}: must be >= 1")
        if self.hosts is not None and self.hosts < 1:
            raise ValueError(f"hosts={self.hosts}: must be >= 1 (or None for this host)")
        if self.routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"routing={self.routing!r}: must be 'round_robin' or 'least_loaded'")


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


class ForgeActor(Actor):
    """Base class of forge's actors. Subclasses add `@endpoint` methods and may override `setup`."""

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
    ) -> type[T]:
        """A copy of this class with its placement set; spawn it with `as_actor` or `as_service`."""
        placement = Placement(procs, hosts, with_gpus, num_replicas, mesh_name, routing)
        # Same module and qualname: spawned processes unpickle the original class; the placement
        # only matters here in the controller.
        return type(cls.__name__, (cls,), {"placement": placement, "__qualname__": cls.__qualname__, "__module__": cls.__module__})

    @endpoint
    async def setup(self) -> None:
        """Run once after construction, before the actor serves; override for async initialisation."""

    @classmethod
    async def as_actor(cls: type[T], *args: Any, **kwargs: Any) -> T:
        """Spawn one actor mesh of `placement.procs` processes and run its `setup` endpoint."""
        mesh = await get_provisioner().get_proc_mesh(
            cls.placement.procs,
            hosts=cls.placement.hosts,
            with_gpus=cls.placement.with_gpus,
            mesh_name=cls.placement.mesh_name or cls.__name__.lower(),
        )
        return await cls._spawn_on(mesh, args, kwargs)

    @classmethod
    async def _spawn_on(cls: type[T], mesh: ProvisionedMesh, args: tuple, kwargs: dict) -> T:
        args = tuple(_plain(a) for a in args)
        kwargs = {k: _plain(v) for k, v in kwargs.items()}
        try:
            actor = mesh.procs.spawn(cls.__name__.lower(), cls, *args, **kwargs)
            await actor.setup.call()
        except BaseException:
            await get_provisioner().stop_proc_mesh(mesh)
            raise
        _MESH_OF[id(actor)] = (actor, mesh)
        return actor

    @classmethod
    async def as_service(cls, *args: Any, **kwargs: Any):
        """Spawn `placement.num_replicas` replicas (each its own proc mesh) behind a `Service`."""
        from forge.service import Service

        return await Service.start(cls, cls.placement, args, kwargs, routing=cls.placement.routing)

    @staticmethod
    async def shutdown(actor: Any) -> None:
        """Stop an actor mesh made by `as_actor` and its processes."""
        entry = _MESH_OF.pop(id(actor), None)
        if entry is not None:
            await get_provisioner().stop_proc_mesh(entry[1])


# Actor handles are Monarch objects; remember each one's mesh here (holding the handle keeps its id unique).
_MESH_OF: dict[int, tuple[Any, ProvisionedMesh]] = {}


def mesh_of(actor: Any) -> ProvisionedMesh | None:
    entry = _MESH_OF.get(id(actor))
    return entry[1] if entry else None


__all__ = ["ForgeActor", "Placement", "endpoint", "mesh_of"]
