"""A job's identity and the clean-up of what it leaves on its hosts: the runtime's, below every plane built on it.

`job_id()` names everything a job leaves outside its processes (shared-memory files, say): the controller's pid,
passed by the provisioner to every process it spawns as FORGE_JOB_ID. A plane that leaves such things registers
how to remove them (`register_cleanup`); the runtime runs every registered clean-up when the job ends (its
shutdown, its processes killed, the interpreter's exit), and the sweeps of jobs that died without one when a
controller starts (`start`). The runtime itself knows nothing of what a plane leaves. Needs only the standard library.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Callable

logger = logging.getLogger(__name__)

JOB_VARIABLE = "FORGE_JOB_ID"
MULTI_HOST_VARIABLE = "FORGE_MULTI_HOST"  # "1" in every process of a job that spans hosts (the provisioner sets it)

_cleanups: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {}
_lock = threading.Lock()
_started = False


def job_id() -> str:
    """Identifies this job's leftovers: the controller's pid, which the provisioner passes to every process it
    spawns as FORGE_JOB_ID (read, never written here: forge.compat, 30)."""
    return os.environ.get(JOB_VARIABLE) or str(os.getpid())


def register_cleanup(name: str, cleanup: Callable[[], object], dead_jobs: Callable[[], object] | None = None) -> None:
    """Run `cleanup()` (remove this job's leftovers of kind `name`) when the job ends, and `dead_jobs()` (remove
    those of jobs whose controller is gone) when a controller starts in this process, or at once where one already
    started. Registering a name again replaces it."""
    with _lock:
        _cleanups[name] = (cleanup, dead_jobs)
        started = _started
    if started and dead_jobs is not None:
        _run(name, dead_jobs)


def start() -> None:
    """This process is a job's controller: sweep dead jobs' leftovers now, and clean this job's up at exit (a
    script that ends without shutting down must not leave them behind). Idempotent."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
        sweeps = [(name, dead) for name, (_, dead) in _cleanups.items() if dead is not None]
    for name, dead in sweeps:
        _run(name, dead)
    atexit.register(cleanup)


def cleanup() -> None:
    """Run every registered clean-up of this job (safe from any thread, and at interpreter exit)."""
    with _lock:
        cleanups = list(_cleanups.items())
    for name, (clean, _) in cleanups:
        _run(name, clean)


def registered() -> list[str]:
    """The names of the clean-ups registered in this process."""
    with _lock:
        return sorted(_cleanups)


def _run(name: str, work: Callable[[], object]) -> None:
    try:
        work()
    except Exception:  # one plane's failure must not keep the others' leftovers
        logger.exception("job clean-up %r failed", name)
