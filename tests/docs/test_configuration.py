"""docs/configuration.md is the reference rendered from the GRPO config dataclasses, `python -m apps.grpo --help`
prints it, and it covers every key with its field's docstring (pure: no processes)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

from apps.config_reference import sections
from apps.grpo.cli import load_job_config
from apps.grpo.config import GRPOConfig
from apps.grpo.config_reference import REGENERATE, reference
from forge.config import parse_args
from tests.docs.snippets import DOCS

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process


def test_the_page_is_the_rendered_reference():
    assert (DOCS / "configuration.md").read_text() == reference(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_help_prints_the_reference(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_job_config(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and out.rstrip().endswith(reference().rstrip())


def keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a config schema, walked here apart from the renderer's walk."""
    found = []
    for field, tp in ((f, get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls)):
        options = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) else [tp]
        if dataclasses.is_dataclass(options[0]):
            found += keys(options[0], f"{prefix}{field.name}.")
        else:
            found.append(f"{prefix}{field.name}")
    return found


def test_the_reference_has_a_row_for_every_key():
    rows = [line for line in reference().splitlines() if line.startswith("| `")]
    assert sorted(row.split("`")[1] for row in rows) == sorted(keys(GRPOConfig))
    assert {"trainer.lora.rank", "task.reward", "hosts.roles", "generator.engine_args"} <= set(keys(GRPOConfig))
    assert all(row.rstrip(" |").split("| ")[-1] for row in rows), "a key without its meaning"


@dataclasses.dataclass
class Undocumented:
    """A section whose second field has no docstring."""

    size: int = 1
    """How many."""
    colour: str = "red"


@dataclasses.dataclass
class Documented:
    """A section."""

    flags: list[str] = dataclasses.field(default_factory=lambda: ["a"])
    """Flags | with a bar."""
    limit: Any = None
    """Limit."""


def test_a_field_without_a_docstring_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Undocumented\.colour: has no docstring"):
        sections(Undocumented, "", "")


def test_rows_give_the_yaml_default_and_escape_table_bars():
    rows = sections(Documented, "x.", "")
    assert "| `x.flags` | list[str] | `[a]` | Flags \\| with a bar. |" in rows
    assert "| `x.limit` | Any | `null` | Limit. |" in rows


def test_an_epilog_is_printed_as_written(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"], epilog="| a | b |\n|---|---|\n  indented line")
    assert "| a | b |\n|---|---|\n  indented line" in capsys.readouterr().out
