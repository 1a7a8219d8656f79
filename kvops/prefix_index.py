"""Which engine holds which cached prefix: an index in Redis for prefix-aware routing.

Worker side: PrefixIndex mirrors the engine's prefix cache into a Redis set of short
block hashes, from the prefix changes its KV feed reports (blocks stored, evicted, the
cache cleared; engine/kv_feed.py), with a full rewrite now and then (the engine's
`prefix-hashes` command) to repair any drift (a lost write, a Redis restart).
Router side: cached_prefix_blocks() counts how many leading blocks of a prompt an
engine holds.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from kvops import live

log = logging.getLogger(__name__)

INDEX_KEY = "kvops:prefix:{engine}"
RESYNC_S = 30.0


class PrefixIndex:
    def __init__(self, engine_name: str, source: Any) -> None:
        self.key = INDEX_KEY.format(engine=engine_name)
        self.source = source  # sends the engine commands (EngineService, EngineCoreClient)
        self._last_full = float("-inf")

    def apply(self, changes: dict) -> None:
        """One feed item's prefix changes (see engine.kv_feed.prefix_changes)."""
        if not (changes["stored"] or changes["evicted"] or changes["cleared"]):
            return
        try:
            pipe = live.redis_client().pipeline(transaction=False)
            if changes["cleared"]:
                pipe.delete(self.key)
            if changes["stored"]:
                pipe.sadd(self.key, *changes["stored"])
            if changes["evicted"]:
                pipe.srem(self.key, *changes["evicted"])
            pipe.execute()
        except Exception as e:  # Redis away: the next full rewrite repairs the index
            log.warning("prefix index update failed: %s", e)
            self._last_full = float("-inf")

    def maybe_rewrite(self) -> None:
        """Write the whole index from the engine's cache, every RESYNC_S."""
        now = time.monotonic()
        if now - self._last_full < RESYNC_S:
            return
        self._last_full = now
        try:
            hashes = self.source.command("prefix-hashes", {})
            pipe = live.redis_client().pipeline(transaction=True)
            pipe.delete(self.key)
            for i in range(0, len(hashes), 10_000):
                pipe.sadd(self.key, *hashes[i:i + 10_000])
            pipe.execute()
        except Exception as e:  # the engine or Redis busy or away: try again soon
            log.warning("prefix index rewrite failed: %s", e)
            self._last_full = now - RESYNC_S + 1.0


def cached_prefix_blocks(engine_name: str, short_hashes: list[str]) -> int:
    """How many leading blocks of this hash chain the engine has cached."""
    if not short_hashes:
        return 0
    present = live.redis_client().smismember(INDEX_KEY.format(engine=engine_name), short_hashes)
    n = 0
    for hit in present:
        if not hit:
            break
        n += 1
    return n


def expect(engine_name: str, short_hashes: list[str]) -> None:
    """Add hashes a job routed to the engine is about to cache."""
    if short_hashes:
        live.redis_client().sadd(INDEX_KEY.format(engine=engine_name), *short_hashes)
