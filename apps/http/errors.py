"""Errors the HTTP layer turns into status codes; each message names the field, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """An error with its HTTP status; `detail` is a string or pydantic-style [{loc, msg, input}] list."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(detail if isinstance(detail, str) else str(detail))
        self.status = status
        self.detail = detail


def not_found(what: str, value: str, known: list[str]) -> ServiceError:
    shown = ", ".join(sorted(known)[:20]) or "none"
    return ServiceError(404, f"{what} {value!r} not found; known: {shown}")


def field_error(loc: list[str | int], value: Any, message: str, status: int = 422) -> ServiceError:
    """A 422 (or `status`) shaped like FastAPI's own validation errors."""
    return ServiceError(status, [{"loc": ["body", *loc], "msg": message, "input": value, "type": "value_error"}])
