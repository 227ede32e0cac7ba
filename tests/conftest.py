"""Session-wide fixtures: every test session stops whatever processes it provisioned."""

import pytest

from forge import provisioner


@pytest.fixture(scope="session", autouse=True)
async def _stop_provisioned_processes():
    yield
    await provisioner.shutdown()
