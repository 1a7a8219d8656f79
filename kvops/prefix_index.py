"""Which engine holds which cached prefix: an index in Redis for prefix-aware routing.

Engine side: PrefixIndexPublisher (a hook on the engine loop thread) mirrors the engine's
prefix cache into a Redis set of short block hashes, from the engine's KV events
(BlockStored adds, BlockEvicted removes, AllBlocksCleared empties), with a full
rewrite now and then to repair any drift (a lost write, a Redis restart).
Router side: cached_prefix_blocks() counts how many leading blocks of a prompt an
engine holds.
"""
from __future__ import annotations

import logging
import time

from kvops import live

log = logging.getLogger(__name__)

INDEX_KEY = "kvops:prefix:{engine}"
RESYNC_S = 30.0


class PrefixIndexPublisher:
    def __init__(self, engine_name: str, engine) -> None:
        self.key = INDEX_KEY.format(engine=engine_name)
        self.queue = engine.events.subscribe(maxlen=1_000_000)
        self._last_full = 0.0

    def __call__(self, engine) -> None:
        events = self.queue.take()
        now = time.monotonic()
        try:
            if now - self._last_full > RESYNC_S or self.queue.num_dropped:
                self.queue.num_dropped = 0
                self._rewrite(engine)
                self._last_full = now
            elif events:
                self._apply(events)
        except Exception as e:  # Redis away: the next full rewrite repairs the index
            log.warning("prefix index update failed: %s", e)
            self._last_full = 0.0

    def _apply(self, events) -> None:
        pipe = live.redis_client().pipeline(transaction=False)
        for event in events:
            if event.type == "BlockStored" and event.block_hashes:
                pipe.sadd(self.key, *event.block_hashes)
            elif event.type == "BlockEvicted" and event.block_hashes:
                pipe.srem(self.key, *[h for h in event.block_hashes if h])
            elif event.type == "AllBlocksCleared":
                pipe.delete(self.key)
        pipe.execute()

    def _rewrite(self, engine) -> None:
        from kvops.engine_service import short_hashes_of_cache
        hashes = short_hashes_of_cache(engine)
        pipe = live.redis_client().pipeline(transaction=True)
        pipe.delete(self.key)
        for i in range(0, len(hashes), 10_000):
            pipe.sadd(self.key, *hashes[i:i + 10_000])
        pipe.execute()


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
