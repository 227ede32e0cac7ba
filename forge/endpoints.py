"""`EndpointActor`: the Monarch `Actor` every forge actor derives from, and the handles that call it.

Its endpoints serve concurrently (each call a task of its own) and an endpoint's exception reaches the caller as
`EndpointError` with the remote traceback, through the `ActorHandle` the spawning code returns. Users subclass
`forge.actor.ForgeActor`, which adds placement (`options(...).as_actor()` / `.as_service()`); the runtime's own
actors (the weight relay, a host's lifeline) derive from this base, so the provisioner that spawns them does not
depend on the user-facing spawning API above it.
"""

from __future__ import annotations

from typing import Any

from forge import compat
from forge.compat import raise_if_failed

from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402
from monarch.actor import Actor, concurrent_endpoint, endpoint  # noqa: E402


class EndpointActor(Actor):
    """Base class of forge's actors. Subclasses add `@endpoint` methods and may override `setup` / `teardown`.

    An actor serves its calls concurrently: each runs as a task of its own, so a call that awaits does not hold up
    the next one (as asyncio code expects).
    """

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

    @endpoint
    async def setup(self) -> None:
        """Run once after construction, before the actor serves; override for async initialisation."""

    @endpoint
    async def teardown(self) -> None:
        """Run before the actor's processes are stopped; override to stop background work."""

    _handle_undeliverable_message = compat.drop_undeliverable

    @classmethod
    def has_teardown(cls) -> bool:
        """Whether a subclass overrides `teardown` (only actors with background work get a teardown call)."""
        return any("teardown" in vars(c) for c in cls.__mro__ if c is not EndpointActor and issubclass(c, EndpointActor))


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

    def __reduce__(self) -> tuple:
        # Passed to another actor's endpoint, a handle stays one there (its calls raise the endpoints' errors too);
        # without this, unpickling would look `__setstate__` up through `__getattr__` before `_mesh` exists.
        return ActorHandle, (self._mesh,)

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


def rank0(values: Any) -> Any:
    """An endpoint called on every rank of a mesh answers per rank; rank 0 speaks for the mesh."""
    return next(iter(values.values())) if hasattr(values, "values") and not isinstance(values, dict) else values
