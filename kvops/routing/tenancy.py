"""Tenants: what sets one user's requests apart from another's inside an engine.

Prefix-cache isolation (KVOPS_PREFIX_SHARING):

`user` (the default): each non-staff user's requests carry a cache salt of their own,
which enters the chained block hash (engine/block_hash.py), so their blocks are found
only by their own requests. Another user cannot learn, from `cached_tokens` or from a
faster first token, whether someone's prompt starts with a guessed block. The salt is
an HMAC of the server's secret key and the user's id: nobody without the key can compute
another tenant's chain, so a block hash seen somewhere cannot be tested against guessed
prompts. Staff share one unsalted cache. Prefixes an operator pins are unsalted and,
being published on purpose, are shared with everyone: a salted request may reuse pinned
blocks of the unsalted chain, and only pinned ones (engine/kv/coordinator.py,
find_prefix).

`global`: one cache for all, as vLLM does without a cache_salt (the most reuse).

Every non-staff user's requests also carry a tenant label (Request.tenant), an HMAC of
its own: the engine's fair share counts sequences by it (EngineConfig.max_batch_share),
and a page tells its viewer's requests from others' by it without learning who the
others are.
"""
from __future__ import annotations

import hashlib
import hmac
import time

from django.conf import settings


def _keyed(purpose: str, owner_pk: int) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), f"kvops-{purpose}:{owner_pk}".encode(),
                    hashlib.sha256).hexdigest()


def cache_salt(owner) -> str | None:
    """The salt of this user's requests (None: the shared cache)."""
    if settings.KVOPS_PREFIX_SHARING == "global" or owner is None or owner.is_staff:
        return None
    return _keyed("cache-salt", owner.pk)


# tenant label -> user name, for staff's pages (labels never change while the secret key
# stays; this process's own). A label it lacks reads only the users added since the last
# read (a deleted user's label, never found, costs one indexed query, not every user);
# the whole list is read again at most every NAMES_RELOAD_S (a user no longer staff).
_names: dict[str, str] = {}
_names_state = {"max_pk": 0, "loaded_at": float("-inf")}
NAMES_RELOAD_S = 300.0


def usernames(labels) -> dict[str, str]:
    """The user names of those tenant labels that are a user's (staff's pages)."""
    wanted = {label for label in labels if label}
    if not wanted <= _names.keys():
        from django.contrib.auth import get_user_model
        users = get_user_model().objects.filter(is_staff=False)
        now = time.monotonic()
        if now - _names_state["loaded_at"] >= NAMES_RELOAD_S:
            _names_state["loaded_at"] = now
        else:
            users = users.filter(pk__gt=_names_state["max_pk"])
        for pk, username in users.values_list("pk", "username"):
            _names[_label(pk)] = username
            _names_state["max_pk"] = max(_names_state["max_pk"], pk)
    return {label: _names[label] for label in wanted if label in _names}


def tenant(owner) -> str | None:
    """The label of this user's requests inside an engine (None: staff, who are exempt
    from the batch share and see every request as theirs to operate)."""
    if owner is None or owner.is_staff:
        return None
    return _label(owner.pk)


def _label(owner_pk: int) -> str:
    return _keyed("tenant", owner_pk)[:16]
