"""The rendezvous store of vLLM's worker serves on loopback only (actors/engines/vllm_worker.py; pure: no vLLM, no
processes). tests/actors/engines/test_vllm.py checks the same on a running engine."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

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


def test_a_one_process_store_named_by_the_hosts_outward_address_listens_on_loopback_only(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
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


def test_a_store_named_by_a_loopback_address_listens_there_and_serves_every_rank(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    port = free_port()
    joined = {}
    other = threading.Thread(target=lambda: joined.setdefault(1, store("127.0.0.1", port, rank=1, world_size=2)))
    other.start()
    first = store("127.0.0.1", port, rank=0, world_size=2)
    other.join(timeout=30)
    first.set("from", "rank 0")
    assert joined[1].get("from") == b"rank 0"
    assert listening_on(port) == ["127.0.0.1"]


# A process group of one, as vLLM's one worker makes (its world group and a sub-group): every address it listens on.
GROUP_OF_ONE = """
import json, os, psutil, socket, sys
import torch.distributed as dist
import actors.engines.vllm_worker
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[1]}:{port}", rank=0, world_size=1)
dist.new_group([0])
print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare: the host's name is changed in a namespace of its own")
def test_gloo_groups_of_a_local_store_listen_on_loopback_where_the_hosts_name_resolves_beyond(tmp_path):
    """A multi-host job's hosts resolve their names to their network address (forge.compat 19), and gloo listens on
    the address the host's name resolves to: simulated with a name mapped to the outward address in a UTS and mount
    namespace of the test's own."""
    try:
        address = outward_address()
    except OSError:
        pytest.skip("no outward address: the host has no route to other hosts")
    (tmp_path / "hosts").write_text(f"127.0.0.1 localhost\n{address} forgetesthost\n")
    environment = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    script = (f"mount --bind {tmp_path / 'hosts'} /etc/hosts && hostname forgetesthost && "
              f"exec {sys.executable} -c '{GROUP_OF_ONE}' {address}")
    done = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", script], capture_output=True, text=True,
                          timeout=60, env=environment, cwd=Path(__file__).resolve().parents[3])
    if done.returncode and "unshare" in done.stderr and "Operation not permitted" in done.stderr:
        pytest.skip(f"namespaces not permitted here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    listening = json.loads(done.stdout.strip().splitlines()[-1])
    assert listening and all(ipaddress.ip_address(ip).is_loopback for ip in listening), listening
