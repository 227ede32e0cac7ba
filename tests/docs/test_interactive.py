"""docs/interactive.md, the interactive walkthrough, replayed prompt by prompt against what it shows
(`python -m tests.docs.transcript`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.monarch  # its session starts Monarch processes: `make test` runs it in a process of its own


@pytest.mark.timeout(900)
def test_the_interactive_walkthrough_prints_what_it_shows():
    result = subprocess.run([sys.executable, "-m", "tests.docs.transcript", "docs/interactive.md"], cwd=ROOT,
                            capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "docs/interactive.md: 0 mismatches" in result.stderr
    assert result.stdout.count(">>> ") >= 60  # the whole session ran, not just its start
