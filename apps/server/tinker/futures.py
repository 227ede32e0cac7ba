"""The Tinker protocol's futures: every training and sampling call is answered at once with a request id, runs in
the background, and its result is fetched with `retrieve_future`. A poll is held until the result is ready or
`hold_s` passes (then `{"type": "try_again"}`: the SDK polls again at once, so a held poll is what keeps it from
spinning). A failure becomes Tinker's `{"error", "category"}`: "user" for a request at fault (a 4xx of forge's
own checks), "server" for anything else; a result is kept for `keep_s` after it is ready (a poll lost on the way
can be repeated), then forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable

from apps.http.errors import ServiceError

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    task: asyncio.Task
    created: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    owner: str | None = None  # the Tinker session that submitted it (its finish drops what it left)


def error_body(error: BaseException) -> dict[str, str]:
    """Tinker's RequestFailedResponse for a failed request."""
    if isinstance(error, ServiceError) and 400 <= error.status < 500:
        return {"error": _message(error), "category": "user"}
    if isinstance(error, ServiceError):
        return {"error": _message(error), "category": "server"}
    return {"error": f"{type(error).__name__}: {error}", "category": "server"}


def _message(error: ServiceError) -> str:
    detail = error.detail
    if isinstance(detail, list):  # pydantic's [{loc, msg, input}]
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" if isinstance(d, dict)
                           else str(d) for d in detail)
    return f"{error.status}: {detail}"


class FutureStore:
    def __init__(self, hold_s: float, keep_s: float) -> None:
        self.hold_s = hold_s
        self.keep_s = keep_s
        self.pending: dict[str, Pending] = {}

    def submit(self, work: Awaitable[Any], owner: str | None = None) -> str:
        """Start `work`; its request id."""
        self._forget_old()
        request_id = f"req-{secrets.token_hex(8)}"
        entry = Pending(asyncio.ensure_future(work), owner=owner)
        entry.task.add_done_callback(lambda _: setattr(entry, "done_at", time.monotonic()))
        self.pending[request_id] = entry
        return request_id

    async def retrieve(self, request_id: str) -> tuple[str, Any]:
        """("result", value) | ("error", Tinker's error body) | ("try_again", None); a 404 for an unknown id."""
        entry = self.pending.get(request_id)
        if entry is None:
            raise ServiceError(404, f"request_id={request_id!r}: no such request on this server (never submitted, "
                                    f"or its result was dropped {self.keep_s:g}s after it was ready)")
        if not entry.task.done():
            await asyncio.wait({entry.task}, timeout=self.hold_s)
        if not entry.task.done():
            return "try_again", None
        if entry.task.cancelled():
            return "error", {"error": "the request was cancelled (its session finished)", "category": "user"}
        error = entry.task.exception()
        if error is not None:
            if not isinstance(error, ServiceError) or error.status >= 500:
                logger.warning("request %s failed: %s: %s", request_id, type(error).__name__, error)
            return "error", error_body(error)
        return "result", entry.task.result()

    def cancel_owned_by(self, owner: str) -> None:
        for entry in self.pending.values():
            if entry.owner == owner and not entry.task.done():
                entry.task.cancel()

    def _forget_old(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, e in self.pending.items() if e.done_at is not None and now - e.done_at > self.keep_s]:
            entry = self.pending.pop(request_id)
            if not entry.task.cancelled():
                entry.task.exception()  # retrieved: nobody polled a failure in time; no "never retrieved" warning
