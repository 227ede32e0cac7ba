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

from forge import compat
from forge.compat import EndpointError, raise_if_failed

from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402
from monarch.actor import Actor, concurrent_endpoint, endpoint  # noqa: E402

from forge.provisioner import ProvisionedMesh, actor_mesh_name, get_provisioner  # noqa: E402

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
    """Base class of forge's actors. Subclasses add `@endpoint` methods and may override `setup`.

    Exceptions raised by endpoints reach callers as `EndpointError` (with the remote traceback) through
    the handles `as_actor` and `as_service` return. An actor serves its calls concurrently: each runs as a task
    of its own, so a call that awaits does not hold up the next one (as asyncio code expects).
    """

    placement: Placement = Placement()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if isinstance(value, EndpointProperty) and not value._explicit_response_port:
                # Each call runs as a task of its own: an endpoint that awaits (an environment's step, a batch
                # being gathered) never holds up the actor's next message. Monarch 0.7 runs a plain endpoint's
                # calls one after another.
                served = concurrent_endpoint(compat.report_endpoint_errors(cls.__name__, name, value._method),
                                             propagate=value._propagator, instrument=value._instrument)
                served.__set_name__(cls, name)
                setattr(cls, name, served)

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

    @endpoint
    async def setup(self) -> None:
        """Run once after construction, before the actor serves; override for async initialisation."""

    @endpoint
    async def teardown(self) -> None:
        """Run before the actor's processes are stopped; override to stop background work."""

    _handle_undeliverable_message = compat.drop_undeliverable

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
        return await cls._spawn_on(mesh, args, kwargs)

    @classmethod
    async def _spawn_on(cls: type[T], mesh: ProvisionedMesh, args: tuple, kwargs: dict) -> T:
        provisioner = get_provisioner()
        args = tuple(_plain(a) for a in args)
        kwargs = {k: _plain(v) for k, v in kwargs.items()}
        try:
            # Shutdown lets a set-up under way finish before it stops the mesh, so no mesh spawned meanwhile is left.
            async with provisioner.busy(f"spawning {cls.__name__} on mesh {mesh.name!r}"):
                name = actor_mesh_name(mesh.name, cls.__name__.lower())
                actor = ActorHandle(mesh.procs.spawn(name, cls, *args, **kwargs))
                if "teardown" in {n for c in cls.__mro__ if c is not ForgeActor for n in vars(c)}:
                    mesh.actors.append(actor)  # only actors with background work get a teardown call
                await actor.setup.call()
        except BaseException:
            await provisioner.stop_proc_mesh(mesh)
            raise
        _MESH_OF[id(actor)] = (actor, mesh)
        return actor  # type: ignore[return-value]

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


class ActorHandle:
    """A Monarch actor mesh whose endpoint calls re-raise the endpoints' exceptions (see `EndpointError`)."""

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._mesh, name)
        if name == "slice":
            return lambda *a, **k: ActorHandle(attribute(*a, **k))
        if hasattr(attribute, "call_one") and hasattr(attribute, "call"):
            return _EndpointHandle(attribute)
        return attribute

    def __repr__(self) -> str:
        return f"ActorHandle({self._mesh!r})"


class _EndpointHandle:
    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        return raise_if_failed(await self._endpoint.call(*args, **kwargs))

    async def call_one(self, *args: Any, **kwargs: Any) -> Any:
        return raise_if_failed(await self._endpoint.call_one(*args, **kwargs))

    async def choose(self, *args: Any, **kwargs: Any) -> Any:
        return raise_if_failed(await self._endpoint.choose(*args, **kwargs))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        self._endpoint.broadcast(*args, **kwargs)


# Actor handles are Monarch objects; remember each one's mesh here (holding the handle keeps its id unique).
_MESH_OF: dict[int, tuple[Any, ProvisionedMesh]] = {}


def rank0(values: Any) -> Any:
    """An endpoint called on every rank of a mesh answers per rank; rank 0 speaks for the mesh."""
    return next(iter(values.values())) if hasattr(values, "values") and not isinstance(values, dict) else values


def mesh_of(actor: Any) -> ProvisionedMesh | None:
    entry = _MESH_OF.get(id(actor))
    return entry[1] if entry else None


__all__ = ["ActorHandle", "EndpointError", "ForgeActor", "Placement", "endpoint", "mesh_of", "raise_if_failed"]
