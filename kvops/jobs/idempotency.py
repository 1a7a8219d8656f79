"""Idempotency-Key on submissions (POST /api/jobs/) and operator actions: a client that
retries a POST (its connection dropped before the answer) with the same key gets the
first call's answer, and nothing happens twice. Keys are per user; a key reused with a
different request is refused (409), as is one whose first call is still being answered.
"""
from __future__ import annotations

HEADER = "Idempotency-Key"
MAX_CHARS = 128


class BadKey(ValueError):
    """The header is not a usable key (HTTP 400)."""


class KeyReused(Exception):
    """The key was used for a different request, or its first call is not answered yet
    (HTTP 409)."""


def key_of(headers) -> str:
    """The request's key ("" if it sent none)."""
    key = headers.get(HEADER, "")
    if not key:
        return ""
    if len(key) > MAX_CHARS or not key.isascii() or not key.isprintable():
        raise BadKey(f"`{HEADER}` must be at most {MAX_CHARS} printable ASCII characters")
    return key
