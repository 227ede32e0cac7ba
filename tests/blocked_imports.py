"""Importing forge's modules in a fresh interpreter whose import system refuses some packages: which modules
import without them, and for each that does not, the import that pulled a refused package in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child: refuse the blocked top-level packages, prove the refusal works, import every module and
# report, for each that fails, the import that pulled a blocked package in. A blocked package is found but fails to
# load: libraries that only probe for one (transformers' `find_spec("peft")`) go on as they would.
_CHILD = """
import importlib, importlib.util, sys, traceback
blocked, modules = sys.argv[1].split(","), sys.argv[2].split(",")

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked in this test")

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Refuse())
for package in blocked:
    try:
        importlib.import_module(package)
    except ImportError:
        continue
    sys.exit(f"the blocker let {package} through")
failures = []
for module in modules:
    try:
        importlib.import_module(module)
    except ImportError as e:
        ours = [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_tb(e.__traceback__)
                if f.filename.startswith(sys.argv[3]) and "site-packages" not in f.filename]
        failures.append(f"{module}: {e} (via {ours[-1] if ours else '?'})")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, ",".join(blocked), ",".join(modules), str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
