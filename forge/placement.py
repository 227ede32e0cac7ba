"""Where a mesh goes: the hosts of its role in the `hosts` config, and the GPUs this host has."""

from __future__ import annotations

import os
from typing import Iterable

from forge.hosts.config import HostsConfig, HostsError
from forge.provisioned_mesh import ProvisionedMesh


def visible_gpus() -> list[int]:
    """The GPUs this controller may hand out: CUDA_VISIBLE_DEVICES, else every device torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:  # no CUDA runtime at all
        return []


def place(hosts: HostsConfig, meshes: Iterable[ProvisionedMesh], role: str, span: int, replica: int,
          procs: int) -> list[int]:
    """The indices of the `span` consecutive hosts (in the host mesh) a mesh of `role` goes on: replica
    `replica` of a service on the next ones in turn, each with room for `procs` more processes beside `meshes`."""
    candidates = hosts.hosts_of(role)
    where = f"hosts.roles.{role}={candidates}" if role in hosts.roles else f"role {role!r} (not in hosts.roles: host 0)"
    if span > len(candidates):
        raise HostsError(f"{where}: a mesh of {span} hosts needs at least {span} hosts for its role")
    start = (replica * span) % len(candidates)
    chosen = sorted(candidates[(start + k) % len(candidates)] for k in range(span))
    if chosen != list(range(chosen[0], chosen[0] + span)):
        raise HostsError(f"{where}: a mesh spanning {span} hosts needs consecutive host indices, got {chosen}")
    used: dict[int, int] = {}
    for mesh in meshes:
        for host in mesh.hosts:
            used[host] = used.get(host, 0) + len(mesh.processes) // len(mesh.hosts)
    for host in chosen:
        hosts.check_capacity(used, host, procs, f"mesh {role!r}")
    return chosen
