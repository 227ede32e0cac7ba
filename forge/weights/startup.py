"""How the weight plane starts on a job: torchstore's controller and storage volume (where the store's keys and
manifests live) on a mesh of the provisioner's, stopped after every other mesh; in a job that spans hosts, one
weight relay per host (forge/weights/relay.py). The provisioner does not know of any of it: this module asks it
for the meshes (`get_proc_mesh`, `spawn_on_host`, `stop_last`); the shared-memory segments' clean-up is registered
with the runtime when forge/weights/segment.py is imported (forge/job.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from forge import compat
from forge.provisioned_mesh import ProvisionedMesh
from forge.provisioner import Provisioner, get_provisioner, spawn_actor
from forge.weights import segment  # noqa: F401 (registers the job's segments' clean-up with the runtime)

logger = logging.getLogger(__name__)

_PLANE = "weights"
TORCHSTORE_SHUTDOWN_S = 20.0


@dataclass
class WeightPlane:
    """What `start_weight_store` started on a provisioner."""

    store_mesh: ProvisionedMesh
    relays: list[Any] = field(default_factory=list)  # one WeightRelay per host of a multi-host job


async def start_weight_store(provisioner: Provisioner | None = None) -> WeightPlane:
    """Start torchstore's controller and storage volume (once per provisioner, default: the job's), and in a job
    that spans hosts one weight relay per host; returns what was started."""
    provisioner = provisioner or get_provisioner()
    plane = provisioner.planes.get(_PLANE)
    if plane is not None:
        return plane
    # The storage volume runs on a mesh of ours, so its output bypasses Monarch's host like every other process's
    # (ProcAgent) and its death is reported like any other mesh's.
    mesh = await provisioner.get_proc_mesh(1, mesh_name="weight_store")
    await compat.initialize_torchstore(mesh.procs)
    plane = provisioner.planes[_PLANE] = WeightPlane(mesh)
    provisioner.stop_last(mesh, _stop_torchstore)
    if provisioner.hosts is not None:  # each version crosses to a host once, whatever reads it there
        plane.relays[:] = await asyncio.gather(*(_start_relay(provisioner, index)
                                                 for index in range(provisioner.hosts.count)))
    return plane


def relays(provisioner: Provisioner | None = None) -> list[Any]:
    """The weight relays started on `provisioner` (default: the job's): one per host, none on one host."""
    plane = (provisioner or get_provisioner()).planes.get(_PLANE)
    return [] if plane is None else list(plane.relays)


async def _start_relay(provisioner: Provisioner, index: int) -> Any:
    from forge.weights.relay import WeightRelay  # Monarch's actor: only where hosts are configured

    mesh = await provisioner.spawn_on_host(index, f"weight_relay{index}")
    return await spawn_actor(WeightRelay, mesh)


async def _stop_torchstore(mesh: ProvisionedMesh) -> None:
    torchstore = compat.import_torchstore()
    if not mesh.failed:
        try:
            await asyncio.wait_for(torchstore.shutdown(), timeout=TORCHSTORE_SHUTDOWN_S)
        except Exception as e:
            logger.debug("torchstore shutdown: %s", e)
    torchstore.reset_client()
