"""A configuration reference rendered from config dataclasses: every key, its type, default and help, as Markdown.

A field's help is its docstring: the string literal right after it in the class body (PEP 257's attribute
docstrings), read from the source with `ast`. A field without one is an error here, so a new field cannot go
undocumented. The apps' `--help` and docs/configuration.md (apps/grpo/config_reference.py) print what `sections`
renders. Plain Python: no torch or Monarch import.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, from the class and the dataclasses it extends."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def class_doc(cls: type) -> str:
    """The class's own docstring (a dataclass without one gets its signature as `__doc__`)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        raise ValueError(f"{cls.__module__}.{cls.__name__}: has no docstring; the configuration reference needs one")
    return " ".join(inspect.cleandoc(doc).split())


def section_class(tp: Any) -> type | None:
    """The dataclass a field of type `tp` holds (also `X | None`), or None for a plain value."""
    options = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) else [tp]
    return options[0] if len(options) == 1 and dataclasses.is_dataclass(options[0]) else None


def type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return "required" if value == MISSING else f"`{yaml_text(value)}`"


def yaml_text(value: Any) -> str:
    """How the value is written in a config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(yaml_text, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections(cls: type, prefix: str, help_text: str) -> list[str]:
    """The section's table, then its subsections, as Markdown."""
    docs, hints = field_docs(cls), get_type_hints(cls)
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        inner = section_class(hints[field.name])
        if inner is not None:  # a section: its class's docstring says what it is
            optional = get_origin(hints[field.name]) in (Union, types.UnionType)
            nested += sections(inner, f"{prefix}{field.name}.", docs.get(field.name, "") if optional else "")
            continue
        if field.name not in docs:
            raise ValueError(f"{cls.__module__}.{cls.__name__}.{field.name}: has no docstring (the string literal "
                             f"after the field); the configuration reference needs one")
        key = f"{prefix}{field.name}"
        rows.append(f"| `{key}` | {cell(type_name(hints[field.name]))} | {cell(default_text(field))} | "
                    f"{cell(docs[field.name])} |")
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    intro = " ".join(filter(None, [class_doc(cls), help_text]))
    head = [f"## {title}", "", f"{intro} `{cls.__name__}` in `{cls.__module__.replace('.', '/')}.py`.", ""]
    table = ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""] if rows else []
    return head + table + nested
