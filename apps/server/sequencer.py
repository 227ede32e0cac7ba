"""Per-session ordering: requests run one at a time in the order of their `seq_id`, whatever order they
arrive in; a request may arrive in several chunks and runs once all of them are in.

A request waiting for a lower seq_id that never comes is not left hanging: after `gap_timeout_s` the
missing seq_id is skipped (and refused if it turns up later), so every request gets an answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from apps.server.errors import ServiceError

Execute = Callable[[int, list[Any]], Awaitable[Any]]  # (seq_id, the chunks' parts in order)


@dataclass
class _Pending:
    seq_id: int
    kind: str
    num_chunks: int
    signature: Any
    execute: Execute
    future: asyncio.Future
    parts: dict[int, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.num_chunks


@dataclass
class Submitted:
    seq_id: int
    future: asyncio.Future
    complete: bool  # this chunk completed its request (the caller waits for the result)
    chunks_received: int


class Sequencer:
    def __init__(self, name: str, gap_timeout_s: float) -> None:
        self.name = name
        self.gap_timeout_s = gap_timeout_s
        self.next_seq = 0
        self._highest = -1
        self._pending: dict[int, _Pending] = {}
        self._skipped: set[int] = set()
        self._wakeup = asyncio.Event()
        self._closed: str | None = None
        self._running: _Pending | None = None
        self._worker = asyncio.ensure_future(self._run())

    def next_free(self) -> int:
        """The seq_id a request without one would get."""
        return max(self.next_seq, self._highest + 1)

    def submit(self, seq_id: int | None, kind: str, execute: Execute, part: Any, *, chunk_index: int = 0,
               num_chunks: int = 1, signature: Any = None) -> Submitted:
        """Register one chunk of request `seq_id` (None: the next free id). Raises ServiceError (409) for a
        seq_id already run or skipped and for chunks that disagree with their request."""
        if self._closed:
            raise ServiceError(404, self._closed)
        if seq_id is None:
            seq_id = self.next_free()
        if seq_id < self.next_seq:
            why = "was skipped after waiting" if seq_id in self._skipped else "has already run"
            raise ServiceError(409, f"seq_id={seq_id}: request {why} in session {self.name!r}; the next expected "
                                    f"seq_id is {self.next_seq}")
        pending = self._pending.get(seq_id)
        if pending is None:
            pending = _Pending(seq_id, kind, num_chunks, signature, execute, asyncio.get_running_loop().create_future())
            self._pending[seq_id] = pending
        elif (pending.kind, pending.num_chunks, pending.signature) != (kind, num_chunks, signature):
            raise ServiceError(409, f"seq_id={seq_id}: already holds a {pending.kind} request with num_chunks="
                                    f"{pending.num_chunks} (and its own loss settings); this {kind} chunk does not "
                                    f"match it")
        if chunk_index in pending.parts:
            raise ServiceError(409, f"seq_id={seq_id}: chunk_index={chunk_index} was already received")
        pending.parts[chunk_index] = part
        self._highest = max(self._highest, seq_id)
        self._wakeup.set()
        return Submitted(seq_id, pending.future, pending.complete, len(pending.parts))

    async def _run(self) -> None:
        waiting_since: float | None = None
        while True:
            pending = self._pending.get(self.next_seq)
            if pending is not None and pending.complete:
                del self._pending[self.next_seq]
                self.next_seq += 1
                waiting_since = None
                self._running = pending
                try:
                    result = await pending.execute(pending.seq_id, [pending.parts[i] for i in range(pending.num_chunks)])
                except Exception as error:  # the request's own failure; the session goes on
                    _settle(pending.future, error=error)
                else:
                    _settle(pending.future, result)
                finally:
                    self._running = None
                continue
            if self._pending:
                now = time.monotonic()
                waiting_since = waiting_since or now
                if now - waiting_since >= self.gap_timeout_s:
                    missing = self.next_seq
                    if pending is not None:
                        del self._pending[missing]
                        _settle(pending.future, error=ServiceError(
                            408, f"seq_id={missing}: only {len(pending.parts)} of num_chunks={pending.num_chunks} "
                                 f"chunks arrived within {self.gap_timeout_s}s"))
                    self._skipped.add(missing)
                    self.next_seq += 1
                    waiting_since = None
                    continue
                timeout = self.gap_timeout_s - (now - waiting_since)
            else:
                waiting_since, timeout = None, None
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def close(self, reason: str) -> None:
        """Fail every request not yet run with `reason` (404) and stop."""
        self._closed = reason
        self._worker.cancel()
        for pending in [*self._pending.values(), *([self._running] if self._running else [])]:
            _settle(pending.future, error=ServiceError(404, reason))
        self._pending.clear()
        await asyncio.gather(self._worker, return_exceptions=True)


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
        future.exception()  # retrieved: chunks that only acknowledged never await it
    else:
        future.set_result(result)
