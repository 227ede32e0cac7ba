"""apps.http.main: the one main() of the HTTP apps (apps.server, apps.gateway), without processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from apps.http.main import _stopped

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module, says", [("apps.server", "The REST training service over forge's trainer"),
                                          ("apps.gateway", "The OpenAI-compatible online-RL gateway")])
def test_help_names_the_app(module, says):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m {module} [-h] [--config PATH]")
    assert says in " ".join(result.stdout.split())


class _Service:
    def __init__(self, watch: asyncio.Future) -> None:
        self._watch = watch

    async def watch(self) -> None:
        await self._watch


async def test_serving_stops_on_the_signal_or_when_a_background_task_of_the_service_ends():
    stop, forever = asyncio.Event(), asyncio.get_running_loop().create_future()
    stopping = asyncio.ensure_future(_stopped(_Service(forever), stop, "forge training service"))
    await asyncio.sleep(0.05)
    assert not stopping.done()
    stop.set()
    await asyncio.wait_for(stopping, 5)  # the signal: returns
    ended = asyncio.get_running_loop().create_future()
    ended.set_result(None)
    with pytest.raises(RuntimeError, match="a background task of the forge training service stopped"):
        await asyncio.wait_for(_stopped(_Service(ended), asyncio.Event(), "forge training service"), 5)
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(KeyError("reaper bug"))
    with pytest.raises(KeyError, match="reaper bug"):
        await asyncio.wait_for(_stopped(_Service(failed), asyncio.Event(), "forge training service"), 5)
