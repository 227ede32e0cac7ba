"""`make test`: the whole suite, as CI runs it.

Each test module marked `monarch` (it starts Monarch processes, a weight store or an app) runs in a pytest process of
its own, one after another, so one module's runtime state (meshes, the torchstore controller, late replies) cannot
leak into the next. When one fails, its failed tests run once more (the whole module if pytest named none) and fail
the suite only if they fail again: Monarch can miss its deadlines on a busy 2-core host (forge.compat 13,
docs/reliability.md); the retry is printed, never silent.

The modules marked `timed` (they assert wall-clock bounds: timeouts, stalls) run first, together in one process. The
rest run together in one pytest process beside all of these, at the lowest CPU priority (`nice 19`): most of a Monarch
module's time is spent waiting for processes to start, stop or answer, and that lane uses the idle cores without
taking any from the other lane's deadlines. Its output is printed at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest"]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def modules_marked(marker: str) -> list[str]:
    listed = subprocess.run([*PYTEST, "--collect-only", "-q", "-m", marker, "tests"], cwd=ROOT,
                            capture_output=True, text=True)
    modules = sorted({line.split("::", 1)[0] for line in listed.stdout.splitlines() if "::" in line})
    if not modules:
        sys.exit(f"no test module is marked {marker}: collection failed?\n{listed.stdout[-3000:]}{listed.stderr[-3000:]}")
    return modules


def run_modules(*modules: str, retry: bool = True) -> tuple[bool, str | None]:
    """Run `modules` in one pytest process: (passed, what passed only on its retry)."""
    print(f"== pytest {' '.join(modules)}", flush=True)
    proc = subprocess.Popen([*PYTEST, "-rfE", "--durations=3", *modules], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    if proc.wait() == 0:
        return True, None
    if not retry:
        return False, None
    failed = " ".join(sorted(set(FAILED.findall("".join(lines))))) or " ".join(modules)
    print(f"== RETRY {failed}: failed once; running again (forge.compat 13: Monarch on a loaded host)", flush=True)
    passed = subprocess.run([*PYTEST, *failed.split()], cwd=ROOT).returncode == 0
    return passed, failed if passed else None


def main() -> int:
    started = time.monotonic()
    timed, modules = modules_marked("timed and not monarch"), modules_marked("monarch")
    with tempfile.TemporaryFile("w+") as rest_log:
        # The lane of the rest: niced, its output kept for the end.
        rest = subprocess.Popen(["nice", "-n", "19", *PYTEST, "-rfE", "--durations=15", "-m", "not monarch and not timed",
                                 "tests"], cwd=ROOT, stdout=rest_log, stderr=subprocess.STDOUT)
        results = [run_modules(*timed, retry=False)] + [run_modules(module) for module in modules]
        rest_code = rest.wait()
        rest_log.seek(0)
        print("== pytest (the rest, niced, run beside the modules above)", flush=True)
        sys.stdout.write(rest_log.read())
    retried = [r for ok, r in results if r]
    if retried:
        print(f"FLAKY (failed once, passed on the retry): {' '.join(retried)}")
    lanes = [" ".join(timed)] + modules
    failed = [m for m, (ok, _) in zip(lanes, results) if not ok] + (["(the rest)"] if rest_code else [])
    minutes = (time.monotonic() - started) / 60
    print(f"TESTS FAILED: {' '.join(failed)} ({minutes:.1f} min)" if failed else f"ALL TESTS PASSED ({minutes:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
