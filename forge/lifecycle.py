"""The lifecycle of a forge job's controller: signals, the fatal-actor watchdog, the exit code and the clean-up.

    import sys
    from forge.lifecycle import run_job

    async def main() -> None:            # spawn actors, do the work; return an exit code, or None for 0
        ...

    sys.exit(run_job(main))

`run_job(main)` runs `main()` in a new event loop and owns every way out of it:
- A fatal actor failure (a mesh's process died; service replicas excepted, their service restarts them) cancels
  `main` and prints `FATAL: actor mesh 'NAME' failed` with Monarch's or the process watcher's cause. Exit code 1.
- An exception out of `main` prints `FATAL: the job failed` with its traceback; a `main` cancelled with no signal (by
  its own code, or a call it awaited cancelled under it) prints `FATAL: the job was cancelled`. Exit code 1.
- SIGINT or SIGTERM asks the job to stop: `on_stop(signal_name)` is called when given (the app finishes what it is
  doing and returns: a training job may save a checkpoint first), otherwise `main` is cancelled. A `main` asked
  to stop has `stop_grace_s` to return (a training job's step and checkpoint may take minutes), then it is
  cancelled. A second signal kills the job's processes and exits at once. Exit code 128 + the signal's number.
- Otherwise the exit code is what `main` returned (None: 0).
- Then, whatever happened, once `main` has finished (a cancelled `main`'s own `finally` clean-up runs first,
  bounded), `forge.provisioner.shutdown()` stops every actor, mesh and weight-store segment the
  job made, bounded in time; what it did not stop is killed (`kill_job_processes`).
- From the moment the job starts ending (`main` returning or cancelled: by a failure, a signal without
  `on_stop`, or the end of the stop's grace) the process exits within `exit_deadline_s`: a Monarch call to a
  dead process never answers, and a job must not hang on one.
- Signals are taken in Python's own handler, not through the event loop, and the deadline and a second signal's
  exit are kept by a thread: a job whose event loop is blocked (code that blocks it by mistake) still ends within
  `stop_grace_s` + `exit_deadline_s` of its first signal, and at once on its second.

A graceful stop, as `apps.grpo` does it (the job finishes its step and checkpoints before `main` returns):

    job = MyJob(cfg)                                  # job.run() checks job.stopping between steps
    sys.exit(run_job(job.run, on_stop=job.request_stop, stop_grace_s=cfg.checkpoint.stop_grace_s))

A server stops the same way: `on_stop` tells it to stop serving, and its own clean-up (closing sessions) runs in
`main`'s `finally`, before the actors are stopped:

    stop = asyncio.Event()                            # serve() returns once it is set
    sys.exit(run_job(lambda: serve(app, stop), on_stop=lambda signal_name: stop.set()))

Monarch is imported when `run_job` starts, not when this module is, so an app parses and validates its arguments
before paying for the heavy imports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from types import ModuleType

EXIT_DEADLINE_S = 25.0  # once `main` has ended or been cancelled, the process leaves within this
STOP_GRACE_S = 25.0  # a `main` asked to stop by a signal returns within this, or it is cancelled
FAILED = 1
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_job(main: Callable[[], Awaitable[int | None]], *, on_stop: Callable[[str], None] | None = None,
            stop_grace_s: float = STOP_GRACE_S, exit_deadline_s: float = EXIT_DEADLINE_S) -> int:
    """Run `main()` with signal handling, the fatal-actor watchdog and the final clean-up; return the exit code.

    `main` is called inside the new event loop (pass the coroutine function, not a coroutine). `on_stop` is
    called with the signal's name ("SIGINT", "SIGTERM") on the first signal, and `main` then has `stop_grace_s` to
    return before it is cancelled; without `on_stop` the first signal cancels `main`. Must be called from the main
    thread (signal handlers).
    """
    for name, value in (("stop_grace_s", stop_grace_s), ("exit_deadline_s", exit_deadline_s)):
        if value <= 0:
            raise ValueError(f"{name}={value}: must be > 0")
    return asyncio.run(_Lifecycle(on_stop, stop_grace_s, exit_deadline_s).run(main))


class _Lifecycle:
    def __init__(self, on_stop: Callable[[str], None] | None, stop_grace_s: float, exit_deadline_s: float) -> None:
        self.on_stop = on_stop
        self.stop_grace_s, self.exit_deadline_s = stop_grace_s, exit_deadline_s
        self.code = FAILED  # what the process exits with if it must exit before `main` has an outcome
        self.signal: signal.Signals | None = None
        self.ending = False  # `main` has an outcome: clean-up is running
        self.main: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._provisioner: ModuleType | None = None
        # The deadline thread wakes at `_signalled` (a signal, or the job is ending); a graceful stop's `main` then
        # has `stop_grace_s` until `_ending` (it returned, or was cancelled); then `exit_deadline_s` or `_at_once`.
        # Events are only ever set: the signal handler may interrupt any code of the main thread.
        self._signalled, self._ending, self._at_once = threading.Event(), threading.Event(), threading.Event()
        self._deadline = threading.Thread(target=self._keep_deadline, daemon=True, name="exit-deadline")

    async def run(self, main: Callable[[], Awaitable[int | None]]) -> int:
        from forge import provisioner  # Monarch: imported only once the app has parsed its arguments

        self._provisioner = provisioner
        self._loop = asyncio.get_running_loop()
        self._deadline.start()
        # signal.signal, not loop.add_signal_handler: the handler runs in the main thread between two bytecodes,
        # even while the event loop is stuck in a call that blocks it.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            self.main = asyncio.ensure_future(main())
            watchdog = asyncio.ensure_future(provisioner.get_provisioner().failures.wait_for_fatal_failure())
            try:
                await asyncio.wait([self.main, watchdog], return_when=asyncio.FIRST_COMPLETED)
                self.code = self._fatal(watchdog.result()) if watchdog.done() else self._outcome()
            finally:
                watchdog.cancel()
                self.ending = True
                self._start_exit_deadline()
                await self._clean_up()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not self.main.done():
            # `main` is stuck on a call to a dead process; asyncio.run would wait for it forever.
            _exit_now(self.code)
        return self.code

    def _fatal(self, failure) -> int:
        self.main.cancel()
        print(f"\nFATAL: actor mesh {failure.mesh_name!r} failed; stopping the job.\n{failure.message}",
              file=sys.stderr, flush=True)
        return FAILED

    def _outcome(self) -> int:
        try:
            returned = self.main.result()
        except asyncio.CancelledError:  # cancelled by a signal, or by `main`'s own code or a call it awaited
            if self.signal:
                return 128 + self.signal.value
            print("\nFATAL: the job was cancelled with no signal (by its own code or a call it awaited):\n"
                  + traceback.format_exc(), file=sys.stderr, flush=True)
            return FAILED
        except Exception:
            print("\nFATAL: the job failed:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
            return FAILED
        if self.signal is not None:
            return 128 + self.signal.value
        return 0 if returned is None else int(returned)

    def _on_signal(self, signum: int, frame: object = None) -> None:
        """Python's signal handler: it records the signal, arms the deadline and hands the stop to the event loop.
        It may interrupt any code of the main thread, so it only writes to stderr's descriptor (a print could
        re-enter a print it interrupted) and sets events."""
        sig = signal.Signals(signum)
        if self.signal is not None or self.ending:  # a second signal, or one during the clean-up: exit now
            self.code = 128 + sig.value
            _write_stderr(f"\n{sig.name} again: killing the job's processes and exiting now\n")
            self._at_once.set()
            self._start_exit_deadline()
            return
        self.signal, self.code = sig, 128 + sig.value
        _write_stderr(f"\n{sig.name}: stopping the job (send it again to exit at once)\n")
        if self.on_stop is None:  # `main` is cancelled: the exit deadline runs from now
            self._start_exit_deadline()
        else:
            self._signalled.set()
        self._loop.call_soon_threadsafe(self._stop_main, sig)

    def _stop_main(self, sig: signal.Signals) -> None:
        if self.on_stop is None:
            self.main.cancel()
            return
        try:
            self.on_stop(sig.name)
        except Exception:
            print("on_stop failed; cancelling the job:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
            self._cancel_main()

    def _cancel_main(self) -> None:
        self.main.cancel()
        self._start_exit_deadline()

    async def _clean_up(self) -> None:
        """Let a cancelled `main` run its own clean-up (its `finally` blocks: an HTTP server closing its sessions),
        then stop every process and segment of the job, leaving time within the deadline to kill what is stuck."""
        if not self.main.done():
            await asyncio.wait([self.main], timeout=0.2 * self.exit_deadline_s)
        try:
            await asyncio.wait_for(self._provisioner.shutdown(), timeout=0.6 * self.exit_deadline_s)
        except Exception as e:
            print(f"shutdown incomplete ({type(e).__name__}: {e}); killing what is left", file=sys.stderr, flush=True)
            self._provisioner.kill_job_processes()

    def _start_exit_deadline(self) -> None:
        """The process ends `exit_deadline_s` from now, whatever the event loop is doing."""
        self._ending.set()
        self._signalled.set()

    def _keep_deadline(self) -> None:
        self._signalled.wait()
        if not self._ending.wait(self.stop_grace_s):  # a graceful stop that outlasted its grace
            _write_stderr(f"the job did not stop within {self.stop_grace_s:g}s of {self.signal.name} (its stop "
                          "grace): cancelling it\n")
            try:
                self._loop.call_soon_threadsafe(self._cancel_main)
            except RuntimeError:  # the loop closed just now: `main` has ended
                pass
            self._ending.set()  # the exit deadline runs from now, also while the event loop is blocked
        if not self._at_once.wait(self.exit_deadline_s):
            print(f"the job did not end within {self.exit_deadline_s:g}s: killing its processes", file=sys.stderr,
                  flush=True)
        self._provisioner.kill_job_processes()
        _exit_now(self.code)


def _write_stderr(text: str) -> None:
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError):  # no stderr to write to
        pass


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
