"""Replay a REPL transcript from a markdown page and compare what it prints with what the page shows.

    python -m tests.docs.transcript docs/interactive.md

Every ```python block made of `>>>` prompts is run, in page order, in one namespace and one event loop, as
`python -m asyncio` runs it (top-level `await` works). The output of each prompt is compared with the lines
after it by doctest's rules: `...` stands for any text (pids, timings, gibberish from a random model), and an
expected traceback matches on its last line. Exits 1 with the first mismatches, 0 when the page is right.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import doctest
import inspect
import io
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.docs.snippets import FENCE

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


@dataclass
class Mismatch:
    line: int  # in the page
    source: str
    want: str
    got: str

    def __str__(self) -> str:
        return f"line {self.line}: >>> {self.source.rstrip()}\n--- the page shows:\n{self.want}--- it printed:\n{self.got}"


def examples(page: str) -> list[tuple[int, doctest.Example]]:
    """The `>>>` examples of every python block, with the page line each starts on."""
    found = []
    for block in FENCE.finditer(page):
        if not block.group(1).lstrip().startswith(">>>"):
            continue
        first_line = page.count("\n", 0, block.start(1)) + 1
        for example in doctest.DocTestParser().get_examples(block.group(1)):
            found.append((first_line + example.lineno, example))
    return found


class Console(io.TextIOBase):
    """The session's stdout: whatever holds on to it (a metrics backend made at one prompt that prints at a later
    one) writes into the output of the prompt running now."""

    def __init__(self) -> None:
        self.current = io.StringIO()

    def write(self, text: str) -> int:
        return self.current.write(text)

    def take(self) -> str:
        text, self.current = self.current.getvalue(), io.StringIO()
        return text


async def run_example(example: doctest.Example, namespace: dict, console: Console) -> str:
    """What the example prints, as the REPL shows it (an expression's value, or a traceback's last line)."""
    try:
        code = compile(example.source, "<console>", "single", flags=FLAGS)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            await result
    except Exception:
        error = traceback.format_exception_only(*sys.exc_info()[:2])[-1]
        return console.take() + "Traceback (most recent call last):\n" + error
    return console.take()


def matches(example: doctest.Example, got: str) -> bool:
    checker = doctest.OutputChecker()
    if example.exc_msg is not None:  # a traceback is expected: its last line must match
        if "Traceback (most recent call last):" not in got:
            return False
        printed, _, error = got.partition("Traceback (most recent call last):\n")
        want_printed = example.want.split("Traceback (most recent call last):")[0]
        return (checker.check_output(want_printed, printed, OPTIONS)
                and checker.check_output(example.exc_msg, error, OPTIONS))
    return checker.check_output(example.want, got, OPTIONS)


async def replay(page: Path) -> list[Mismatch]:
    namespace: dict = {"__name__": "__console__", "asyncio": asyncio}
    mismatches = []
    console, terminal = Console(), sys.stdout
    with contextlib.redirect_stdout(console):
        for line, example in examples(page.read_text()):
            got = await run_example(example, namespace, console)
            terminal.write(f">>> {example.source.rstrip()}\n{got}")
            terminal.flush()
            if not matches(example, got):
                mismatches.append(Mismatch(line, example.source, example.want, got))
    return mismatches


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    mismatches = asyncio.run(replay(Path(argv[0])))
    for mismatch in mismatches:
        print(f"\nMISMATCH {argv[0]} {mismatch}", file=sys.stderr)
    print(f"\n{argv[0]}: {len(mismatches)} mismatches", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
