"""The weight plane: how a policy version's bytes go from the trainer to every generator.

- manifest.py: what a version is (its manifest: each tensor's dtype, shape, place and checksums), its errors, layout.
- checksums.py: the checksums of a version's pieces, and the threaded piece work that takes and checks them.
- segment.py: a version's bytes in one shared-memory file per host: writer, readers, mappings, a job's clean-up.
- publisher.py: the publisher's side: gather to rank 0, pieces written and hashed on every core, DMA from a GPU.
- store.py: `WeightStore`: versions, keys and manifests in torchstore, publish / latest_version / fetch / delete.
- relay.py: one relay per host of a multi-host job: each version crosses the link once, streamed.
- startup.py: `start_weight_store`: torchstore and the relays on the provisioner's meshes.

Nothing below (forge/provisioner.py, forge/processes.py, forge/hosts/, forge/job.py) imports this package. This
file imports nothing eagerly: the shared-memory data plane runs without Monarch or torchstore.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "start_weight_store":
        from forge.weights.startup import start_weight_store

        return start_weight_store
    if name == "WeightStore":
        from forge.weights.store import WeightStore

        return WeightStore
    raise AttributeError(f"module 'forge.weights' has no attribute {name!r}")
