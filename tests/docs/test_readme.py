"""The README is the front door: short, its examples copied from examples that tests run, its picture the
architecture page's, and its layer table naming every top-level folder of the checkout."""

from __future__ import annotations

import re
import subprocess

from tests.docs.snippets import DOCS, FENCE
from tests.docs.test_docs import RUN_BY

ROOT = DOCS.parent
README = ROOT / "README.md"
MAX_LINES = 250
# Where the README's examples come from: the docs pages' blocks that a test runs or replays, and the example apps
# (tests/apps/test_examples.py runs them).
TRANSCRIPTS = ("interactive.md",)  # replayed by tests.docs.transcript (test_docs.py)
EXAMPLE_APPS = sorted((ROOT / "apps" / "examples").glob("*.py"))


def sources_of_tested_examples() -> list[str]:
    sources = [path.read_text() for path in EXAMPLE_APPS]
    for page, tests in RUN_BY.items():
        if tests or page in TRANSCRIPTS:
            sources += FENCE.findall((DOCS / page).read_text())
    return sources


def is_excerpt(block: str, source: str) -> bool:
    """`block` is consecutive whole lines of `source`."""
    return f"\n{block}" in f"\n{source}"


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_every_readme_example_is_copied_from_a_tested_example():
    blocks = FENCE.findall(README.read_text())
    assert len(blocks) >= 4  # the ways to use forge each show one
    sources = sources_of_tested_examples()
    stale = [block.splitlines()[0] for block in blocks if not any(is_excerpt(block, s) for s in sources)]
    assert not stale, f"README blocks that no tested example contains (copy them again): {stale}"


def test_is_excerpt_wants_whole_consecutive_lines():
    source = "a = 1\nb = 2\nc = 3\n"
    assert is_excerpt("b = 2\nc = 3\n", source)
    assert not is_excerpt("a = 1\nc = 3\n", source) and not is_excerpt("= 2\n", source)


def picture(page: str) -> str:
    """The page's first fenced block without a language."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M)
    return next(body for language, body in blocks if not language)


def test_the_readme_picture_is_the_architecture_pages():
    assert "controller process" in picture("README.md")
    assert picture("README.md") == picture("docs/architecture.md")


def test_the_layer_table_names_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {path.split("/")[0] for path in tracked.splitlines() if "/" in path and not path.startswith(".")}
    listed = set(re.findall(r"^\| `(\w+)/` \|", README.read_text(), re.M))
    assert listed == folders
