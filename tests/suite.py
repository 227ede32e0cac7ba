"""`make test`: the whole suite, as CI runs it, in two lanes side by side.

- At full priority, one after another: the modules marked `timed` (they assert wall-clock bounds: timeouts, stalls,
  "within 30 s"). Those without Monarch processes run together in one pytest process; each one marked `monarch`
  runs in a pytest process of its own.
- At the lowest CPU priority (`nice 19`), beside them: every other `monarch` module, each in a process of its own,
  and the rest of the suite together in one process. Most of a Monarch module's time is spent waiting for processes
  to start, stop or answer; this lane uses the cores that leaves idle without taking any from the timed lane.

A module marked `monarch` starts Monarch processes, a weight store or an app: one pytest process each, so one
module's runtime state (meshes, the torchstore controller, late replies) cannot leak into the next. When one fails,
its failed tests run once more (the whole module if pytest named none) and fail the suite only if they fail again:
Monarch can miss its deadlines on a busy 2-core host (forge.compat 13, docs/reliability.md); the retry is printed,
never silent. The niced lane's output is printed after the timed lane's.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest"]
NICE = ["nice", "-n", "19"]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def modules_marked(marker: str) -> list[str]:
    listed = subprocess.run([*PYTEST, "--collect-only", "-q", "-m", marker, "tests"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode not in (0, 5):  # 5: nothing collected
        sys.exit(f"collecting `-m {marker}` failed:\n{listed.stdout[-3000:]}{listed.stderr[-3000:]}")
    return sorted({line.split("::", 1)[0] for line in listed.stdout.splitlines() if "::" in line})


def run(args: list[str], out: TextIO, *, niced: bool = False, retry: bool = True) -> tuple[bool, str | None]:
    """One pytest process, its output to `out`: (passed, what passed only on its retry)."""
    print(f"== pytest {' '.join(args)}", file=out, flush=True)
    proc = subprocess.Popen([*(NICE if niced else []), *PYTEST, "-rfE", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        out.write(line)
        lines.append(line)
    out.flush()
    if proc.wait() == 0:
        return True, None
    if not retry:
        return False, None
    failed = " ".join(sorted(set(FAILED.findall("".join(lines))))) or " ".join(a for a in args if a.startswith("tests"))
    print(f"== RETRY {failed}: failed once; running again (forge.compat 13: Monarch on a loaded host)", file=out,
          flush=True)
    again = subprocess.run([*(NICE if niced else []), *PYTEST, *failed.split()], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    out.write(again.stdout)
    return again.returncode == 0, failed if again.returncode == 0 else None


def niced_lane(modules: list[str], out: io.StringIO, results: dict[str, tuple[bool, str | None]]) -> None:
    rest_out = io.StringIO()
    rest = threading.Thread(target=lambda: results.__setitem__("(the rest)", run(
        ["--durations=15", "-m", "not monarch and not timed", "tests"], rest_out, niced=True, retry=False)))
    rest.start()
    for module in modules:
        results[module] = run(["--durations=3", module], out, niced=True)
    rest.join()
    out.write(rest_out.getvalue())


def main() -> int:
    started = time.monotonic()
    timed, monarch_all = set(modules_marked("timed")), set(modules_marked("monarch"))  # collection imports every module
    timed_alone, timed_monarch = sorted(timed - monarch_all), sorted(timed & monarch_all)
    monarch = sorted(monarch_all - timed)
    if not (timed_alone and timed_monarch and monarch):
        sys.exit("a lane of the suite collected no module: collection failed?")
    results: dict[str, tuple[bool, str | None]] = {}
    niced_out = io.StringIO()
    beside = threading.Thread(target=niced_lane, args=(monarch, niced_out, results))
    beside.start()
    results["(timed)"] = run(["--durations=3", *timed_alone], sys.stdout, retry=False)
    for module in timed_monarch:
        results[module] = run(["--durations=3", module], sys.stdout)
    beside.join()
    print("== the niced lane, run beside the modules above", flush=True)
    sys.stdout.write(niced_out.getvalue())
    retried = [again for _, again in results.values() if again]
    if retried:
        print(f"FLAKY (failed once, passed on the retry): {' '.join(retried)}")
    failed = [name for name, (ok, _) in results.items() if not ok]
    minutes = (time.monotonic() - started) / 60
    print(f"TESTS FAILED: {' '.join(failed)} ({minutes:.1f} min)" if failed else f"ALL TESTS PASSED ({minutes:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
