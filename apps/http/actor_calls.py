"""The server's calls into its actors, each bounded by a timeout, with their failures as HTTP errors: a call past
its timeout is a 504 naming the setting, an actor's exception a 500 with its cause, a generator service with no
replica left a 503."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from apps.http.errors import ServiceError
from forge.actor import EndpointError
from forge.service import NoHealthyReplicaError

T = TypeVar("T")


def endpoint_failure(error: EndpointError) -> ServiceError:
    """An actor endpoint's exception as an HTTP error: always the server's failure (500, with the cause).
    A request's own faults are found before it reaches an actor (schemas, `batches`, the parts' checks) and
    answered 4xx there; what an actor raises (CUDA out of memory, a broken checkpoint file) is not the
    client's to fix."""
    head = str(error).split("\n--- remote traceback", 1)[0]
    return ServiceError(500, f"server-side failure: {head}")


async def bounded(call: Awaitable[T], timeout: float, late: str) -> T:
    """`call`'s answer; a 504 saying `late` once it has taken `timeout` seconds (the call is cancelled)."""
    try:
        return await asyncio.wait_for(call, timeout)
    except asyncio.TimeoutError:
        raise ServiceError(504, late) from None
    except EndpointError as e:
        raise endpoint_failure(e) from None
    except NoHealthyReplicaError as e:
        raise ServiceError(503, str(e)) from None
