"""forge.processes: what a shutdown kills (mesh processes and what they started) and what it spares."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from forge import processes

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)

# A stand-in for Monarch 0.7's tree: a mesh process (a direct child of the controller) -> an engine it started;
# and a process that is not Monarch's.
TREE = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"


def test_mesh_processes_and_their_children_are_found_and_nothing_else():
    mesh = subprocess.Popen([sys.executable, "-c", TREE, "monarch-mesh-process"])
    other = subprocess.Popen(["sleep", "120"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(mesh.pid).children():
            assert time.monotonic() < deadline, "the stand-in tree did not start"
            time.sleep(0.1)
        (engine,) = psutil.Process(mesh.pid).children()
        assert sorted(processes.monarch_children()) == sorted([mesh.pid, engine.pid])

        processes.kill(processes.monarch_children())
        deadline = time.monotonic() + 10
        while processes.is_alive(mesh.pid) or processes.is_alive(engine.pid):
            assert time.monotonic() < deadline, "killed processes still alive"
            time.sleep(0.1)
        assert processes.is_alive(other.pid)
    finally:
        processes.kill(processes.monarch_children())
        other.kill()
        mesh.wait(timeout=10)
        other.wait(timeout=10)


# -- processes of other hosts: known by (host, pid), never looked up in this host's table ----------------------


def _mesh_on_another_host(pid: int):
    from forge.provisioned_mesh import ProvisionedMesh

    # A pid that exists here (this very process) but belongs to another host's table.
    return ProvisionedMesh("remote-0", procs=None, agents=None, gpus=[],
                           processes=[processes.ProcessId("hostB", pid, local=False)], hosts=[1])


def test_a_remote_process_is_named_by_host_and_pid_and_has_no_local_pid():
    import os

    import pytest

    mesh = _mesh_on_another_host(os.getpid())
    assert str(mesh.processes[0]) == f"hostB:{os.getpid()}"
    assert processes.local_pids(mesh.processes) == []
    with pytest.raises(ValueError, match=r"runs on other hosts \(hostB:\d+\).*\(host, pid\)"):
        mesh.pids


async def test_the_controller_neither_reads_nor_reports_a_remote_pid_from_its_own_table():
    import asyncio
    import os

    from forge.provisioner import Provisioner

    provisioner = Provisioner()
    alive_here = _mesh_on_another_host(os.getpid())  # would read this process's memory
    gone_here = _mesh_on_another_host(2**22 - 7)  # no such pid here: a local check would call it dead
    provisioner.meshes.update({"remote-0": alive_here, "remote-1": gone_here})
    assert set(provisioner.memory_rss()) == {"controller"}
    watcher = asyncio.ensure_future(provisioner.failures.poll_processes(poll_s=0.05))
    await asyncio.sleep(0.5)
    watcher.cancel()
    assert not provisioner.failures.fatal_failures and not gone_here.failed
