"""The operating-system side of a job's processes: liveness, resident memory, and killing what is left.

Pids are only meaningful on the host that reads them: every function here is about processes of this
host (the controller's descendants, or pids its own agents reported from this host).
"""

from __future__ import annotations

import contextlib
import socket

import psutil

from forge import weight_store


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_this_host(pid: int, started: float) -> bool:
    """Whether the process `pid`, started at `started` (psutil create_time), runs on this host."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1e-3
    except psutil.Error:
        return False


def kill(pids: list[int]) -> None:
    """Kill each live process of `pids` outright (a process that ignored a stop request, or a wedged one)."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()


def monarch_children(*, hosts: bool = True) -> list[int]:
    """Pids of this process's descendants that Monarch started: the host agent (`this_host()`'s process, a
    direct child, left out when `hosts=False`), the proc meshes' processes it spawned, and what those started
    (a vLLM engine-core process, say)."""
    me = psutil.Process()
    pids: dict[int, None] = {}
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("monarch" in part for part in child.cmdline()) and (hosts or child.ppid() != me.pid):
                pids[child.pid] = None
                if child.ppid() != me.pid:  # a mesh process: its own children go with it
                    pids.update((grandchild.pid, None) for grandchild in child.children(recursive=True))
    return list(pids)


def kill_job_processes(*, hosts: bool = True) -> None:
    """Kill the Monarch processes this controller started and remove its shared-memory segments (safe from
    any thread, and at interpreter exit). `hosts=False` spares the host agent, so that the controller can
    start new meshes afterwards (Monarch caches `this_host()` for the life of the process)."""
    kill(monarch_children(hosts=hosts))
    weight_store.remove_job_segments()


def resident_memory(pids: dict[str, int]) -> dict[str, int]:
    """Resident bytes of the controller and of each named live process."""
    rss = {"controller": psutil.Process().memory_info().rss}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            rss[name] = psutil.Process(pid).memory_info().rss
    return rss


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
