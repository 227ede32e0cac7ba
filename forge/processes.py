"""The operating-system side of a job's processes: liveness, resident memory, and killing what is left.

Pids are only meaningful on the host that reads them: every process of a job is known by a `ProcessId`
(its host and its pid there), and the functions here that take bare pids are about processes of the host
that calls them (the controller for its own processes, a host's agent for that host's).
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

import psutil

from forge import job


@dataclass(frozen=True)
class ProcessId:
    """A process of the job: `pid` on `host` (a name for messages); `local` when that host is the controller's,
    the only case where this process's table may be read or signalled for it."""

    host: str
    pid: int
    local: bool

    def __str__(self) -> str:  # messages: a process of the controller's host is named by its pid as before
        return str(self.pid) if self.local else f"{self.host}:{self.pid}"


def local_pids(ids: list[ProcessId]) -> list[int]:
    """The pids of the processes of `ids` that run on this host."""
    return [p.pid for p in ids if p.local]


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


def monarch_children() -> list[int]:
    """Pids of this process's descendants that Monarch started (a proc mesh's processes are the controller's
    own children with Monarch 0.7) and what those started (a vLLM engine-core process, say)."""
    me = psutil.Process()
    pids: dict[int, None] = {}
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("monarch" in part for part in child.cmdline()):
                pids[child.pid] = None
                pids.update((grandchild.pid, None) for grandchild in child.children(recursive=True))
    return list(pids)


def kill_job_processes() -> None:
    """Kill the Monarch processes this controller started and remove what the job left on this host (the clean-ups
    registered with forge/job.py; safe from any thread, and at interpreter exit)."""
    kill(monarch_children())
    job.cleanup()


def dead_among(pids: list[int]) -> list[int]:
    """The pids of `pids` (of this host) whose process has exited."""
    return [pid for pid in pids if not is_alive(pid)]


def resident_memory(pids: dict[str, int]) -> dict[str, int]:
    """Resident bytes of this process (`controller`) and of each named live process of this host."""
    rss = {"controller": psutil.Process().memory_info().rss}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            rss[name] = psutil.Process(pid).memory_info().rss
    return rss


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` (of this host) right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
