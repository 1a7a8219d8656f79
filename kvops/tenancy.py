"""Prefix-cache isolation between users (KVOPS_PREFIX_SHARING).

`user` (the default): each non-staff user's requests carry a cache salt of their own,
which enters the chained block hash (engine/block_hash.py), so their blocks are found
only by their own requests. Another user cannot learn, from `cached_tokens` or from a
faster first token, whether someone's prompt starts with a guessed block. Staff share
one unsalted cache. Prefixes an operator pins are unsalted and, being published on
purpose, are shared with everyone: a salted request may reuse pinned blocks of the
unsalted chain, and only pinned ones (engine/kv_cache_manager.py, find_prefix).

`global`: one cache for all, as vLLM does without a cache_salt (the most reuse).
"""
from __future__ import annotations

from django.conf import settings


def cache_salt(owner) -> str | None:
    """The salt of this user's requests (None: the shared cache)."""
    if settings.KVOPS_PREFIX_SHARING == "global" or owner is None or owner.is_staff:
        return None
    return f"user-{owner.pk}"
