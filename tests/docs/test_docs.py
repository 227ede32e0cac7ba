"""The docs run: every ```python block in docs/ is run by a test (the interactive walkthrough, a REPL transcript, is
replayed by tests/docs/test_interactive.py)."""

from __future__ import annotations

import re
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
    "interactive.md": [],  # a REPL transcript only: replayed by tests/docs/test_interactive.py
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
