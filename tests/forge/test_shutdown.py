"""`forge.provisioner.shutdown()` in every state a job can be in when it is called.

Each case is a user script run as its own controller process: it must exit with its own code, print no
Monarch panic, and leave no process and no shared-memory segment behind. The actor is defined in the
script itself (Monarch sends classes of `__main__` to its processes by value).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forge.weights.store import SHM_DIR
from tests.support import job_processes

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

PRELUDE = """
import asyncio, os, signal, sys, time
from forge.actor import ForgeActor, endpoint
from forge.provisioned_mesh import ShutDownError
from forge.provisioner import get_provisioner, shutdown
from forge.service import Service

class Echo(ForgeActor):
    @endpoint
    async def echo(self, value):
        return os.getpid(), value

    @endpoint
    async def hang(self):
        await asyncio.sleep(3600)

class SlowStart(Echo):
    @endpoint
    async def setup(self):
        await asyncio.sleep(float(os.environ.get("SLOW_START_S", "8")))

async def kill_replica(service, index):
    os.kill(service.replicas[index].mesh.pids[0], signal.SIGKILL)
    while service.replicas[index].healthy:
        await asyncio.sleep(0.05)
"""

MONARCH_PANICS = ("panicked at", "could not propagate supervision event", "coordinator port is not set", "crashing")


def run_script(tmp_path: Path, body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.pid = proc.pid
    return result


def leftovers(controller_pid: int, wait_s: float = 30.0) -> tuple[list[int], list[str]]:
    """Processes of the job and its /dev/shm segments still there after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        procs = job_processes(controller_pid)
        segments = [p.name for p in SHM_DIR.glob(f"forge-{controller_pid}-*")]
        if (not procs and not segments) or time.monotonic() > deadline:
            return procs, segments
        time.sleep(0.5)


def assert_clean_exit(result: subprocess.CompletedProcess, code: int = 0) -> None:
    assert result.returncode == code, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    panics = [line for line in result.stderr.splitlines() if any(p in line for p in MONARCH_PANICS)]
    assert not panics, "Monarch panicked:\n" + "\n".join(panics[:5])
    procs, segments = leftovers(result.pid)
    assert not procs, f"processes left behind: {procs}"
    assert not segments, f"shared-memory segments left behind: {segments}"


def test_shutdown_while_a_replica_restart_is_in_flight(tmp_path):
    """The user script from issue 13: SIGKILL a replica, route 20 calls, shut down during the restart."""
    result = run_script(tmp_path, """
    async def main():
        service = await Echo.options(num_replicas=2).as_service()
        await kill_replica(service, 0)
        answers = [await service.echo.route(i) for i in range(20)]
        assert [value for _, value in answers] == list(range(20))
        assert service._restarting, "the restart should still be under way"
        await shutdown()
        print("shut down", flush=True)
        try:
            await service.echo.route(0)
        except ShutDownError as e:
            print("refused:", e, flush=True)
    asyncio.run(main())
    """)
    assert_clean_exit(result)
    assert "shut down" in result.stdout
    assert "refused: service 'echo' has been stopped" in result.stdout


def test_shutdown_during_start_up(tmp_path):
    result = run_script(tmp_path, """
    async def main():
        # Spawning the replicas' meshes and their 8 s set-up: shutdown lands in the middle of one of them.
        starting = asyncio.ensure_future(SlowStart.options(num_replicas=2).as_service())
        await asyncio.sleep(2.0)
        await shutdown()
        try:
            await starting
            print("start-up finished before the shutdown", flush=True)
        except ShutDownError as e:
            print("start-up refused:", e, flush=True)
        try:
            await Echo.options().as_actor()
            print("spawned after shutdown", flush=True)
        except ShutDownError:
            print("unexpected: refused after a finished shutdown", flush=True)
        await shutdown()
    asyncio.run(main())
    """)
    assert_clean_exit(result)
    assert "start-up refused: " in result.stdout
    # A finished shutdown leaves the controller usable: a new job can start.
    assert "spawned after shutdown" in result.stdout


def test_shutdown_twice_and_concurrently(tmp_path):
    result = run_script(tmp_path, """
    async def main():
        actor = await Echo.options(procs=2).as_actor()
        await asyncio.gather(shutdown(), shutdown())
        await shutdown()
        print("meshes left:", len(get_provisioner().meshes), flush=True)
        await shutdown()
    asyncio.run(main())
    """)
    assert_clean_exit(result)
    assert "meshes left: 0" in result.stdout


def test_shutdown_after_a_replica_died_and_was_never_restarted(tmp_path):
    result = run_script(tmp_path, """
    async def main():
        service = await Service.start(Echo, Echo.options(num_replicas=2).placement, (), {}, max_restarts=0)
        await kill_replica(service, 1)
        assert not service._restarting
        print("served by", len({pid for pid, _ in [await service.echo.route(i) for i in range(4)]}), "replica", flush=True)
        await shutdown()
    asyncio.run(main())
    """)
    assert_clean_exit(result)
    assert "served by 1 replica" in result.stdout


def test_shutdown_with_a_hung_endpoint_call(tmp_path):
    result = run_script(tmp_path, """
    async def main():
        service = await Echo.options(num_replicas=1).as_service()
        hung = asyncio.ensure_future(service.hang.route())
        await asyncio.sleep(1.0)
        started = time.monotonic()
        await shutdown()
        print(f"shutdown took {time.monotonic() - started:.0f}s; hung call done: {hung.done()}", flush=True)
        hung.cancel()
    asyncio.run(main())
    sys.exit(3)  # the caller's own exit code survives
    """)
    assert_clean_exit(result, code=3)
    took = int(result.stdout.split("shutdown took ")[1].split("s")[0])
    assert took < 60, result.stdout


@pytest.mark.timeout(300)
def test_a_script_that_never_calls_shutdown_leaves_nothing_behind(tmp_path):
    """The weights a script published to shared memory go at interpreter exit; its processes with it."""
    result = run_script(tmp_path, """
    import torch
    from forge.weights import start_weight_store
    from forge.weights.store import SHM_DIR, WeightStore, job_id

    async def main():
        await start_weight_store()
        await WeightStore("policy").publish({"w": torch.ones(4, 4)}, version=0)
        print("segments:", len(list(SHM_DIR.glob(f"forge-{job_id()}-*"))), flush=True)
    asyncio.run(main())
    """)
    assert "segments: 1" in result.stdout, result.stdout + result.stderr[-3000:]
    assert_clean_exit(result)


def test_replicas_lost_and_restarted_leave_no_monarch_process_after_shutdown(tmp_path):
    """Issue 28's script, twice over: SIGKILL a replica, 20 routed calls, wait for the restart; again; shut down.
    Nothing Monarch started is left when `shutdown()` returns (Monarch 0.7 runs a mesh's processes as the
    controller's own children, with no host process: forge.compat, 26, gone)."""
    result = run_script(tmp_path, """
    from forge.processes import monarch_children

    async def main():
        service = await Echo.options(num_replicas=2).as_service()
        print("mesh processes before:", len(monarch_children()), flush=True)
        for _ in range(2):
            await kill_replica(service, 0)
            assert [value for _, value in [await service.echo.route(i) for i in range(20)]] == list(range(20))
            while service._restarting:
                await asyncio.sleep(0.1)
        await shutdown()
        print("mesh processes left:", monarch_children(), flush=True)
    asyncio.run(main())
    """)
    assert_clean_exit(result)
    assert "mesh processes left: []" in result.stdout, result.stdout
    assert int(result.stdout.split("mesh processes before: ")[1].split()[0]) >= 2, result.stdout
