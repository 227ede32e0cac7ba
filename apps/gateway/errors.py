"""The gateway's errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so that OpenAI
clients show the message (the `openai` package puts it in the exception's text and sets `.type`, `.param`,
`.code`)."""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 422: "invalid_request_error",
          429: "rate_limit_error"}
_CODES = {400: "bad_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          409: "conflict", 422: "invalid_request", 429: "capacity_exceeded", 500: "internal_error",
          502: "no_healthy_generator", 503: "unavailable", 504: "timeout"}


def openai_error(status: int, detail: Any) -> dict:
    """`detail` is a message or a list of field errors ([{loc, msg, input}], FastAPI's and forge's 422s)."""
    param = None
    if isinstance(detail, list):
        fields = [(_field(error.get("loc", ())), error.get("msg", "")) for error in detail if isinstance(error, dict)]
        message = "; ".join(f"{name}: {msg}" if name else msg for name, msg in fields) or str(detail)
        param = (fields[0][0] or None) if fields else None
    else:
        message = str(detail)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": _CODES.get(status, str(status))}}


def _field(loc: Any) -> str:
    """["body", "messages", 0, "role"] -> "messages.0.role"."""
    parts = [str(part) for part in loc]
    return ".".join(parts[1:] if parts[:1] in (["body"], ["query"], ["path"], ["header"]) else parts)
