"""API-key checks shared by the training service and the gateway: `Authorization: Bearer <key>` (what the
OpenAI client sends) or `X-API-Key: <key>`."""

from __future__ import annotations

import secrets

from fastapi import Request

from apps.http.errors import ServiceError


def presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer " and header[7:].strip():
        return header[7:].strip()
    return request.headers.get("x-api-key") or None


def require_key(request: Request, expected: str, what: str = "API key") -> str:
    """401 unless the request carries `expected`."""
    key = presented_key(request)
    if key is None:
        raise ServiceError(401, f"missing {what}: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
    if not secrets.compare_digest(key.encode(), expected.encode()):
        raise ServiceError(401, f"invalid {what}")
    return key
