"""forge.lifecycle.run_job, driven as a user's app: a small script run as a subprocess, then its exit code, its
output, how long it took and what it left behind."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import WatchedProcess, job_processes

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

ROOT = Path(__file__).resolve().parents[2]

# Each mode is one way a job ends. The script prints "ready" once it is where the test acts on it.
APP = textwrap.dedent('''
    import asyncio, os, sys, time
    from forge import provisioner
    from forge.lifecycle import run_job

    mode, grace, deadline = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    stop_reasons = []

    def ready(*details):
        print("ready", *details, flush=True)

    async def spawn_echo_mesh():
        from tests.support import EchoActor
        await EchoActor.options(procs=2, mesh_name="echo").as_actor()
        (mesh,) = provisioner.get_provisioner().meshes.values()
        return mesh.pids

    async def main():
        if mode == "returns_3":
            return 3
        if mode == "raises":
            raise ValueError("the app's own error")
        if mode == "cancels_itself":  # a call main awaited was cancelled under it
            raise asyncio.CancelledError("cancelled under main")
        if mode == "spawns_and_returns":
            ready(*await spawn_echo_mesh())
            return None
        if mode == "spawns_and_waits":  # the test kills one of the mesh's processes
            pids = await spawn_echo_mesh()
            stop_everything = provisioner.shutdown

            async def shutdown():
                print("provisioner shutdown", flush=True)
                await stop_everything()
            provisioner.shutdown = shutdown
            ready(*pids)
            try:
                await asyncio.Event().wait()
            finally:  # an app's own clean-up, e.g. a server closing its sessions, before its actors stop
                await asyncio.sleep(0.5)
                print("main's clean-up done", flush=True)
        if mode == "graceful":  # stops by itself once asked
            ready()
            while not stop_reasons:
                await asyncio.sleep(0.05)
            print("stopped gracefully after", stop_reasons, flush=True)
            return None
        if mode == "slow_graceful":  # its step and checkpoint outlast the exit deadline, within the stop's grace
            ready()
            while not stop_reasons:
                await asyncio.sleep(0.05)
            await asyncio.sleep(3 * deadline)
            print("stopped gracefully after", stop_reasons, flush=True)
            return None
        if mode in ("cancelled", "ignores_stop"):
            ready()
            try:
                await asyncio.sleep(3600)
            finally:
                print("main cancelled", flush=True)
        if mode == "blocks_its_loop":  # a call that blocks the event loop by mistake: no callback runs any more
            ready()
            time.sleep(3600)
        if mode == "shutdown_blocks":  # a clean-up stuck inside a blocking call: only the deadline ends it
            async def blocking_shutdown():
                time.sleep(3600)
            provisioner.shutdown = blocking_shutdown
            return None
        if mode == "shutdown_hangs":  # a clean-up awaiting an answer that never comes
            async def hanging_shutdown():
                await asyncio.sleep(3600)
            provisioner.shutdown = hanging_shutdown
            return None

    on_stop = None if mode == "cancelled" else stop_reasons.append
    code = run_job(main, on_stop=on_stop, stop_grace_s=grace, exit_deadline_s=deadline)
    print("run_job returned", code, flush=True)
    sys.exit(code)
''')


class App(WatchedProcess):
    def __init__(self, tmp_path: Path, mode: str, deadline_s: float = 60, grace_s: float = 60) -> None:
        script = tmp_path / "app.py"
        script.write_text(APP)
        super().__init__([sys.executable, str(script), mode, str(grace_s), str(deadline_s)], tmp_path / f"{mode}.log",
                         ROOT)

    def wait_ready(self, timeout: float = 300) -> list[str]:
        """The words printed after "ready" (e.g. pids)."""
        ready: list[list[str]] = []

        def printed_ready() -> bool:
            ready[:] = [line.split()[1:] for line in self.output().splitlines() if line.startswith("ready")]
            return bool(ready)

        self.wait_for(printed_ready, "it was ready", timeout)
        return ready[0]


def test_the_exit_code_is_what_main_returned(tmp_path):
    app = App(tmp_path, "returns_3")
    assert app.finish() == 3, app.output()
    assert "run_job returned 3" in app.output()


def test_an_exception_in_main_is_reported_and_exits_1(tmp_path):
    app = App(tmp_path, "raises")
    assert app.finish() == 1
    out = app.output()
    assert "FATAL: the job failed" in out and "ValueError: the app's own error" in out, out


def test_a_main_cancelled_with_no_signal_is_reported_and_exits_1(tmp_path):
    app = App(tmp_path, "cancels_itself")
    assert app.finish() == 1
    out = app.output()
    assert "FATAL: the job was cancelled with no signal" in out and "cancelled under main" in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_asks_main_to_stop_and_the_exit_code_names_it(tmp_path, sig):
    app = App(tmp_path, "graceful")
    app.wait_ready()
    app.proc.send_signal(sig)
    assert app.finish(timeout=30) == 128 + sig.value, app.output()
    assert f"stopped gracefully after ['{sig.name}']" in app.output()


def test_a_graceful_stop_may_outlast_the_exit_deadline_within_its_grace(tmp_path):
    # A training step and its checkpoint can take minutes: the exit deadline must not cut a graceful stop short.
    app = App(tmp_path, "slow_graceful", deadline_s=2, grace_s=60)
    app.wait_ready()
    app.proc.send_signal(signal.SIGINT)
    assert app.finish(timeout=60) == 130, app.output()
    out = app.output()
    assert "stopped gracefully after ['SIGINT']" in out and "run_job returned 130" in out, out
    assert "did not" not in out, out


def test_a_stop_that_outlasts_its_grace_is_cancelled(tmp_path):
    app = App(tmp_path, "ignores_stop", deadline_s=60, grace_s=2)
    app.wait_ready()
    app.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert app.finish(timeout=60) == 143, app.output()
    assert time.monotonic() - sent < 30  # the grace, then main's clean-up: not the 60 s exit deadline
    out = app.output()
    assert "the job did not stop within 2s of SIGTERM (its stop grace): cancelling it" in out, out
    assert "main cancelled" in out and "run_job returned 143" in out, out
    assert "did not end within" not in out, out


def test_without_on_stop_a_signal_cancels_main(tmp_path):
    app = App(tmp_path, "cancelled")
    app.wait_ready()
    app.proc.send_signal(signal.SIGINT)
    assert app.finish(timeout=30) == 130, app.output()
    assert "main cancelled" in app.output()


@pytest.mark.parametrize("mode, first, second", [
    ("ignores_stop", signal.SIGINT, signal.SIGTERM),  # main keeps running after on_stop
    ("blocks_its_loop", signal.SIGTERM, signal.SIGINT),  # the event loop itself is blocked
])
def test_a_second_signal_exits_at_once(tmp_path, mode, first, second):
    app = App(tmp_path, mode, deadline_s=120, grace_s=120)
    app.wait_ready()
    app.proc.send_signal(first)
    time.sleep(1)
    assert app.proc.poll() is None, "the first signal leaves the job its deadline"
    app.proc.send_signal(second)
    assert app.finish(timeout=30) == 128 + second.value, app.output()  # well before the 120 s deadline
    out = app.output()
    assert f"{second.name} again: killing the job's processes and exiting now" in out
    assert "run_job returned" not in out  # it did not wait for main


def test_a_signal_ends_a_job_whose_event_loop_is_blocked_within_grace_and_deadline(tmp_path):
    app = App(tmp_path, "blocks_its_loop", deadline_s=3, grace_s=2)
    app.wait_ready()
    app.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert app.finish(timeout=30) == 128 + signal.SIGTERM.value, app.output()
    assert time.monotonic() - sent < 20
    out = app.output()
    assert "SIGTERM: stopping the job" in out and "did not stop within 2s of SIGTERM" in out, out
    assert "the job did not end within 3s: killing its processes" in out, out


def test_the_deadline_ends_a_clean_up_that_blocks(tmp_path):
    app = App(tmp_path, "shutdown_blocks", deadline_s=3)
    started = time.monotonic()
    code = app.finish(timeout=60)
    out = app.output()
    assert code == 0, out  # main's outcome stands
    assert "the job did not end within 3s: killing its processes" in out
    assert "run_job returned" not in out
    assert time.monotonic() - started < 30


def test_a_clean_up_that_hangs_is_cut_short_and_the_rest_killed(tmp_path):
    app = App(tmp_path, "shutdown_hangs", deadline_s=10)
    assert app.finish(timeout=60) == 0, app.output()
    out = app.output()
    assert "shutdown incomplete (TimeoutError" in out and "run_job returned 0" in out, out
    assert "did not end within" not in out  # ended by the shutdown timeout, before the deadline


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clean_up_stops_the_jobs_processes(tmp_path):
    app = App(tmp_path, "spawns_and_returns")
    pids = [int(p) for p in app.wait_ready()]
    assert len(pids) == 2 and set(pids) <= set(job_processes(app.proc.pid)), app.output()
    assert app.finish() == 0, app.output()
    assert job_processes(app.proc.pid) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_actor_process_ends_the_job_fast_naming_it(tmp_path):
    app = App(tmp_path, "spawns_and_waits")
    victim = int(app.wait_ready()[0])
    killed = time.monotonic()
    subprocess.run(["kill", "-9", str(victim)], check=True)
    assert app.finish(timeout=60) == 1, app.output()
    assert time.monotonic() - killed < 30
    out = app.output()
    assert "FATAL: actor mesh 'echo-" in out and f"process {victim} of mesh 'echo-" in out, out
    assert out.index("main's clean-up done") < out.index("provisioner shutdown"), out
    assert job_processes(app.proc.pid) == []
