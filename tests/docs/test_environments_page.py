"""docs/environments.md followed as a user would: the files it shows are the example files as they are, its command
runs an apps.grpo job on the environment (its environments in their own process), and the errors it shows are what
that command prints. Runs a job (Monarch processes): this module runs in its own pytest process."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.docs.snippets import DOCS, python_blocks

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

PAGE = "environments.md"
EXAMPLES = DOCS / "examples"
ROOT = DOCS.parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (DOCS / PAGE).read_text(), re.S | re.M)


def shown_runs() -> list[tuple[str, str]]:
    """The page's ```text blocks that show a command ("$ ...") and what it prints."""
    runs = []
    for block in blocks("text"):
        first, _, printed = block.partition("\n")
        if first.startswith("$ "):
            runs.append((first[2:], printed.strip()))
    return runs


def run(line: str, *overrides: str, timeout: float) -> subprocess.CompletedProcess:
    """A shell line `VAR=value ... python -m ...` run from the checkout as written, with this interpreter and only the
    line's own PYTHONPATH."""
    words = shlex.split(line)
    assigned = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        assigned[name] = value
    assert words[0] == "python", line
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | assigned
    return subprocess.run([sys.executable, *words[1:], *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_page_shows_its_example_files_as_they_are():
    assert python_blocks(PAGE) == [(EXAMPLES / "lookup_env.py").read_text()]
    assert blocks("yaml") == [(EXAMPLES / "lookup_env.yaml").read_text()]


@pytest.mark.parametrize("line, printed", shown_runs(), ids=["no_pythonpath", "misspelled_option"])
def test_the_errors_the_page_shows_are_what_its_command_prints_before_anything_starts(line, printed):
    result = run(line, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == printed
    assert not result.stdout  # the config is refused before it is printed: nothing started


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pages_command_trains_on_the_environment(tmp_path):
    """The page's command, cut to 2 steps without the final evaluation: the isolated environments' process imports the
    user's module through the command's PYTHONPATH and plays every episode."""
    (script,) = blocks("bash")
    run_dir = tmp_path / "run"
    result = run(script.strip(), f"run_dir={run_dir}", f"model_cache={tmp_path / 'cache'}", "steps=2",
                 "eval.at_end=false", timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert any("env/model_turns" in r for r in rows) and not any(r.get("env/failures") for r in rows)
    assert "environments-r0" in result.stdout  # the environments ran in their own process
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"]["trained"] == 2 * 64
