"""The rendezvous store of vLLM's worker serves on loopback only (actors/engines/vllm_worker.py; pure: no vLLM, no
processes). tests/actors/engines/test_vllm.py checks the same on a running engine."""

from __future__ import annotations

import ipaddress
import socket
import threading
from datetime import timedelta

import psutil
import pytest
from torch.distributed import rendezvous

import actors.engines.vllm_worker  # noqa: F401  (installs the loopback store, as in vLLM's worker)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outward_address() -> str:
    """This host's address towards other hosts, found as vLLM finds it for its one-worker rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 80))  # nothing is sent
        return s.getsockname()[0]


def listening_on(port: int) -> list[str]:
    """The addresses this process listens on at `port`."""
    return [c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def store(host: str, port: int, rank: int, world_size: int):
    store, _, _ = next(rendezvous(f"tcp://{host}:{port}?rank={rank}&world_size={world_size}",
                                  timeout=timedelta(seconds=30)))
    return store


def test_a_one_process_store_named_by_the_hosts_outward_address_listens_on_loopback_only():
    try:
        host = outward_address()
    except OSError:
        pytest.skip("no outward address: the host has no route to other hosts")
    port = free_port()
    only = store(host, port, rank=0, world_size=1)
    only.set("key", "value")
    assert only.get("key") == b"value"
    assert listening_on(port) and all(ipaddress.ip_address(ip).is_loopback for ip in listening_on(port)), \
        listening_on(port)


def test_a_store_named_by_a_loopback_address_listens_there_and_serves_every_rank():
    port = free_port()
    joined = {}
    other = threading.Thread(target=lambda: joined.setdefault(1, store("127.0.0.1", port, rank=1, world_size=2)))
    other.start()
    first = store("127.0.0.1", port, rank=0, world_size=2)
    other.join(timeout=30)
    first.set("from", "rank 0")
    assert joined[1].get("from") == b"rank 0"
    assert listening_on(port) == ["127.0.0.1"]
