"""forge.processes: what a shutdown kills (mesh processes and what they started) and what it spares."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from forge import processes

# A stand-in for Monarch's tree: a host agent (a direct child) -> a mesh process -> an engine it started.
TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)",
                  "monarch-mesh-process"])
time.sleep(120)
"""


def test_mesh_processes_and_their_children_are_found_and_the_host_agent_spared_on_request():
    host = subprocess.Popen([sys.executable, "-c", TREE, "monarch-host-agent"])
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(host.pid).children(recursive=True)) < 2:
            assert time.monotonic() < deadline, "the stand-in tree did not start"
            time.sleep(0.1)
        mesh_and_engine = processes.monarch_children(hosts=False)
        assert host.pid not in mesh_and_engine and len(mesh_and_engine) == 2
        assert sorted(processes.monarch_children()) == sorted([host.pid, *mesh_and_engine])

        processes.kill(mesh_and_engine)
        deadline = time.monotonic() + 10
        while any(processes.is_alive(pid) for pid in mesh_and_engine):
            assert time.monotonic() < deadline, "killed processes still alive"
            time.sleep(0.1)
        assert processes.is_alive(host.pid)
    finally:
        processes.kill(processes.monarch_children())
        host.wait(timeout=10)
