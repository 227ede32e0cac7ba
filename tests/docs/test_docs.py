"""The docs run: every ```python block in docs/ is run by a test, and the interactive walkthrough is replayed
prompt by prompt against what it shows (`python -m tests.docs.transcript`, Monarch processes: this module runs
in its own pytest process)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.snippets import DOCS, FENCE, python_blocks

ROOT = DOCS.parent
# The program blocks of each page, in page order, and the test that runs each.
RUN_BY = {
    "serving.md": ["tests/apps/server/test_service.py::test_the_serving_docs_client_snippet_runs_against_the_server",
                   "tests/apps/server/test_lora.py::test_the_serving_docs_lora_snippet_runs_against_the_server",
                   "tests/apps/server/test_tinker_sdk.py::test_the_serving_docs_tinker_snippet_runs_against_the_server",
                   "tests/apps/gateway/test_gateway.py::test_the_serving_docs_gateway_snippet_runs_against_the_gateway"],
    "interactive.md": [],  # a REPL transcript only: replayed below
    # Prose, tables, shell commands and YAML only.
    **{page: [] for page in ("architecture.md", "benchmarks.md", "changelog.md", "configuration.md",
                             "distillation.md", "eval.md", "gpus.md", "hosts.md", "lora.md", "multiturn.md",
                             "off_policy.md", "reliability.md", "several_hosts.md", "sft.md", "stack.md")},
    # The page's environment module, imported by the job its command runs (tests/docs/test_environments_page.py).
    "environments.md": ["tests/docs/test_environments_page.py::test_the_pages_command_trains_on_the_environment"],
}


def test_every_python_block_in_the_docs_is_run_by_a_test():
    assert sorted(RUN_BY) == sorted(p.name for p in DOCS.glob("*.md")), "a page without tests, or a test without its page"
    for page, tests in RUN_BY.items():
        assert len(python_blocks(page)) == len(tests), f"docs/{page}: {len(python_blocks(page))} program blocks"
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), test


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))])
def test_examples_do_not_use_the_test_helpers(page):
    code = "\n".join(FENCE.findall((ROOT / page).read_text()))
    assert not re.search(r"forge\.testing|tests\.support", code), f"{page}: examples must not use test helpers"


@pytest.mark.timeout(900)
def test_the_interactive_walkthrough_prints_what_it_shows():
    result = subprocess.run([sys.executable, "-m", "tests.docs.transcript", "docs/interactive.md"], cwd=ROOT,
                            capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "docs/interactive.md: 0 mismatches" in result.stderr
    assert result.stdout.count(">>> ") >= 60  # the whole session ran, not just its start
