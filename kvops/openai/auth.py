"""Who calls /v1 and /tokenize: the user of the request's DRF token, sent as `Bearer <key>`
or `Token <key>` (kvops/infra/api_key.py), each key looked up at most once every few
seconds."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpRequest, JsonResponse
from rest_framework.authtoken.models import Token

from kvops.infra import api_key
from kvops.openai import errors

TOKEN_CACHE_S = 5.0  # a deleted token or deactivated user is refused this long after, at most


def _token_user(key: str):
    try:
        token = Token.objects.select_related("user").filter(key=key).first()
        return token.user if token is not None and token.user.is_active else None
    finally:
        close_old_connections()


class TokenUsers:
    """Bearer tokens' users, each key looked up at most once every TOKEN_CACHE_S: a
    database read per call (a connection, under SQLite, opened for it) was the largest
    part of a /v1 call's cost. One lookup per key at a time: a burst of calls with a new
    key waits for the first one's answer instead of each opening a connection."""

    def __init__(self, lookup: Callable[[str], Any] = _token_user) -> None:
        self._lookup = lookup
        self._users: dict[str, tuple[float, Any]] = {}  # key -> (checked at, user)
        self._pending: dict[tuple, asyncio.Future] = {}  # (event loop, key) -> its lookup

    async def user(self, key: str):
        now = time.monotonic()
        cached = self._users.get(key)
        if cached is not None and now - cached[0] < TOKEN_CACHE_S:
            return cached[1]
        slot = (asyncio.get_running_loop(), key)
        pending = self._pending.get(slot)
        if pending is None:
            pending = self._pending[slot] = asyncio.ensure_future(
                sync_to_async(self._lookup, thread_sensitive=False)(key))
            pending.add_done_callback(lambda _: self._pending.pop(slot, None))
        user = await asyncio.shield(pending)
        if len(self._users) > 10_000:  # keys that stopped coming are dropped now and then
            self._users.clear()
        self._users[key] = (now, user)
        return user


_tokens = TokenUsers()  # this web process's


async def authenticate(request: HttpRequest):
    """The user of the request's token, or None."""
    key = api_key.key_of(request.headers.get("Authorization", ""))
    if not key:
        return None
    return await _tokens.user(key)


def unauthorized() -> JsonResponse:
    return errors.error(401, "missing or invalid API key: send `Authorization: Bearer <token>` "
                        "(or `Token <token>`)",
                        type_="authentication_error", code="invalid_api_key")
