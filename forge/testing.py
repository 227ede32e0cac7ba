"""Actors for forge's own tests and for users testing their apps (importable by spawned processes)."""

from __future__ import annotations

import asyncio
import os

from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric


class EchoActor(ForgeActor):
    """Answers with its process id so tests can see which replica served a call."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.calls = 0
        self.setup_done = False

    @endpoint
    async def setup(self) -> None:
        self.setup_done = True

    @endpoint
    async def echo(self, value: object, delay: float = 0.0) -> tuple[str, int, object]:
        self.calls += 1
        if delay:
            await asyncio.sleep(delay)
        return self.tag, os.getpid(), value

    @endpoint
    async def info(self) -> dict:
        return {"pid": os.getpid(), "calls": self.calls, "setup_done": self.setup_done, "env": dict(os.environ)}

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def record(self, name: str, value: float, reduce: str = "mean") -> None:
        record_metric(name, value, reduce)
