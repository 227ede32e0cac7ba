"""The fenced code blocks of the docs, for the tests that run them (so the docs cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)  # the body of a ```python block (transcript.py too)


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of docs/<page> that are programs (REPL transcripts, `>>>`, are replayed by
    tests/docs/transcript.py instead)."""
    blocks = FENCE.findall((DOCS / page).read_text())
    return [block for block in blocks if not block.lstrip().startswith(">>>")]


def run_block(code: str, replace: dict[str, str] | None = None) -> dict:
    """Run one block as a script; returns its namespace. `replace`: literal substitutions (a documented default
    such as a port, for the one the test's server listens on), each of which must occur in the block."""
    for old, new in (replace or {}).items():
        assert old in code, f"the block no longer contains {old!r}: update the test with the docs"
        code = code.replace(old, new)
    namespace: dict = {"__name__": "__doc_snippet__"}
    exec(compile(code, "<docs snippet>", "exec"), namespace)
    return namespace
