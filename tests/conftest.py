"""Session-wide set-up: the processes tests start can import `tests.support`, and every test session
stops whatever processes it provisioned."""

import os
from pathlib import Path

import pytest

from forge import provisioner

# The processes a test starts (Monarch's proc meshes, apps run as subprocesses) import `tests.support` by
# name, like the tests themselves; only the test run puts the repository root on their path.
_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p and p != _ROOT]])


@pytest.fixture(scope="session", autouse=True)
async def _stop_provisioned_processes():
    yield
    await provisioner.shutdown()
