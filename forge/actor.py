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

import functools
import inspect
import logging
import traceback
from dataclasses import dataclass, is_dataclass
from typing import Any, TypeVar

import forge.native

forge.native.setup()

from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402
from monarch.actor import Actor, endpoint  # noqa: E402

from forge.provisioner import ProvisionedMesh, get_provisioner  # noqa: E402

T = TypeVar("T", bound="ForgeActor")
logger = logging.getLogger(__name__)


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


class EndpointError(RuntimeError):
    """An exception raised inside an actor's endpoint, re-raised in the caller with the remote traceback."""


@dataclass(frozen=True)
class _RaisedInEndpoint:
    """What an endpoint returns instead of raising (see `ForgeActor.__init_subclass__`)."""

    actor: str
    endpoint: str
    error: str  # "ValueError: ..."
    remote_traceback: str

    def exception(self) -> EndpointError:
        return EndpointError(f"{self.actor}.{self.endpoint} raised {self.error}\n"
                             f"--- remote traceback ---\n{self.remote_traceback}")


def raise_if_failed(value: Any) -> Any:
    """Turn an endpoint's reported exception back into one (values of a whole mesh too)."""
    if isinstance(value, _RaisedInEndpoint):
        raise value.exception()
    if hasattr(value, "values") and callable(value.values) and not isinstance(value, dict):
        for item in value.values():
            if isinstance(item, _RaisedInEndpoint):
                raise item.exception()
    return value


def _reporting_errors(cls_name: str, name: str, method: Any) -> Any:
    # Monarch 0.1.2 can wedge or crash the controller when an endpoint raises (a reply with a remote
    # traceback racing its ack), so forge's endpoints never raise across the wire: they return the error
    # and the caller's handle re-raises it.
    def report(error: Exception) -> _RaisedInEndpoint:
        return _RaisedInEndpoint(cls_name, name, f"{type(error).__name__}: {error}", traceback.format_exc())

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def wrapped(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except Exception as error:
                return report(error)
    else:
        @functools.wraps(method)
        def wrapped(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                return report(error)
    return wrapped


class ForgeActor(Actor):
    """Base class of forge's actors. Subclasses add `@endpoint` methods and may override `setup`.

    Exceptions raised by endpoints reach callers as `EndpointError` (with the remote traceback) through
    the handles `as_actor` and `as_service` return.
    """

    placement: Placement = Placement()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if isinstance(value, EndpointProperty) and not value._explicit_response_port \
                    and not getattr(value._method, "_forge_reports_errors", False):
                value._method = _reporting_errors(cls.__name__, name, value._method)
                value._method._forge_reports_errors = True

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

    @endpoint
    async def teardown(self) -> None:
        """Run before the actor's processes are stopped; override to stop background work."""

    def _handle_undeliverable_message(self, message: Any) -> bool:
        # A reply whose caller has died (a killed replica, a stopped client) is not this actor's failure.
        logger.debug("%s: undeliverable message dropped: %s", type(self).__name__, message)
        return True

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
            actor = ActorHandle(mesh.procs.spawn(cls.__name__.lower(), cls, *args, **kwargs))
            if "teardown" in {n for c in cls.__mro__ if c is not ForgeActor for n in vars(c)}:
                mesh.actors.append(actor)  # only actors with background work get a teardown call
            await actor.setup.call()
        except BaseException:
            await get_provisioner().stop_proc_mesh(mesh)
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
