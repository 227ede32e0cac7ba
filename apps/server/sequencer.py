"""Per-session ordering: requests run one at a time in the order of their `seq_id`, whatever order they
arrive in; a request may arrive in several chunks and runs once all of them are in.

Nothing waits in silence, and nothing runs out of order:
- a request the server refuses before queueing it (a 4xx: a malformed body, a bad field) gives up its
  seq_id at once (`refuse`), so the requests numbered after it do not wait for it;
- when the next seq_id has not arrived (or not all of its chunks) for `gap_timeout_s` while later requests
  wait, every waiting request fails with an error that names the missing seq_id, and the session goes on
  after them. A late request with a seq_id given up either way is refused (409) with the reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from apps.http.errors import ServiceError

Execute = Callable[[int, list[Any]], Awaitable[Any]]  # (seq_id, the chunks' parts in order)
GAP_SETTING = "sessions.sequence_gap_timeout_s"


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
        self._refused: dict[int, str] = {}  # seq_id -> why it will never run
        self._skipped: list[tuple[int, int, str]] = []  # [first, last] seq_ids given up after a gap, and why
        self._progress = time.monotonic()  # when the wait for `next_seq` last saw progress
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
        seq_id already run, refused or skipped, and for chunks that disagree with their request."""
        if self._closed:
            raise ServiceError(404, self._closed)
        if seq_id is None:
            seq_id = self.next_free()
        gone = self._given_up(seq_id)
        if gone is not None:
            raise ServiceError(409, f"seq_id={seq_id}: {gone} in session {self.name!r}; send the request again with "
                                    f"a new seq_id (the next free one is {self.next_free()})")
        if seq_id < self.next_seq:
            raise ServiceError(409, f"seq_id={seq_id}: request has already run in session {self.name!r}; the next "
                                    f"expected seq_id is {self.next_seq}")
        pending = self._pending.get(seq_id)
        if pending is None:
            if not self._pending:
                self._progress = time.monotonic()  # the first waiter: the gap clock starts now
            pending = _Pending(seq_id, kind, num_chunks, signature, execute, asyncio.get_running_loop().create_future())
            self._pending[seq_id] = pending
        elif (pending.kind, pending.num_chunks, pending.signature) != (kind, num_chunks, signature):
            raise ServiceError(409, f"seq_id={seq_id}: already holds a {pending.kind} request with num_chunks="
                                    f"{pending.num_chunks} (and its own loss settings); this {kind} chunk does not "
                                    f"match it")
        if chunk_index in pending.parts:
            raise ServiceError(409, f"seq_id={seq_id}: chunk_index={chunk_index} was already received")
        pending.parts[chunk_index] = part
        if seq_id == self.next_seq:
            self._progress = time.monotonic()  # the awaited request is arriving
        self._highest = max(self._highest, seq_id)
        self._wakeup.set()
        return Submitted(seq_id, pending.future, pending.complete, len(pending.parts))

    def refuse(self, seq_id: int, reason: str) -> None:
        """Request `seq_id` was refused before it was queued: it will never run, so nothing waits for it.
        Chunks of it that were accepted earlier are dropped with it."""
        pending = self._pending.get(seq_id)
        if seq_id < self.next_seq or self._given_up(seq_id) is not None or self._closed or (pending and pending.complete):
            return  # already run or given up; or a duplicate of a whole request that stays queued
        why = f"was refused ({reason})"
        if pending is not None:  # the refused chunk's request can never be completed
            del self._pending[seq_id]
            _settle(pending.future, error=ServiceError(409, f"seq_id={seq_id}: {why}"))
        self._refused[seq_id] = why
        self._highest = max(self._highest, seq_id)
        self._wakeup.set()

    def _given_up(self, seq_id: int) -> str | None:
        if seq_id in self._refused:
            return self._refused[seq_id]
        return next((why for first, last, why in self._skipped if first <= seq_id <= last), None)

    async def _run(self) -> None:
        while True:
            head = self.next_seq
            pending = self._pending.get(head)
            if head in self._refused:
                self.next_seq += 1
                self._progress = time.monotonic()
                continue
            if pending is not None and pending.complete:
                del self._pending[head]
                self.next_seq += 1
                self._running = pending
                try:
                    result = await pending.execute(head, [pending.parts[i] for i in range(pending.num_chunks)])
                except Exception as error:  # the request's own failure; the session goes on
                    _settle(pending.future, error=error)
                else:
                    _settle(pending.future, result)
                finally:
                    self._running = None
                    self._progress = time.monotonic()  # the gap clock counts from the end of the last run
                continue
            timeout = None
            if self._pending:  # later requests wait for `head`
                waited = time.monotonic() - self._progress
                if waited >= self.gap_timeout_s:
                    self._give_up_waiting(head, pending)
                    continue
                timeout = self.gap_timeout_s - waited
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _give_up_waiting(self, head: int, pending: _Pending | None) -> None:
        """`head` is missing (or incomplete) past the gap timeout: fail it and every request waiting behind it."""
        wait = f"{self.gap_timeout_s:g}s ({GAP_SETTING})"
        missing = (f"arrived in only {len(pending.parts)} of num_chunks={pending.num_chunks} chunks" if pending
                   else "never arrived")
        last = max(self._pending)
        skipped = f"seq_ids {head}-{last}" if last > head else f"seq_id {head}"
        for seq_id, waiting in self._pending.items():
            if seq_id == head:
                message = f"seq_id={head}: only {len(waiting.parts)} of num_chunks={waiting.num_chunks} chunks " \
                          f"arrived within {wait}; the request is dropped"
            else:
                message = (f"seq_id={seq_id} waited {wait} for seq_id={head}, which {missing}. Requests run only in "
                           f"seq_id order, so {skipped} are skipped: send them again with new seq_ids (the next "
                           f"free one is {last + 1})")
            _settle(waiting.future, error=ServiceError(409, message))
        self._skipped.append((head, last, f"was skipped after waiting {wait} for seq_id={head}, which {missing}"))
        self._pending.clear()
        self.next_seq = last + 1
        self._progress = time.monotonic()

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
