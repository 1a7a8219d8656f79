"""Which engine holds which cached prefix: an index in Redis for prefix-aware routing.

Worker side: PrefixIndex mirrors the engine's prefix cache into Redis sets of short
block hashes, one for the GPU pool and one for the CPU tier (EngineConfig.
cpu_prefix_cache: a hit there is copied back instead of recomputed), from the prefix
changes its KV feed reports (blocks stored, evicted, the cache cleared;
engine/kv_feed.py), with a full rewrite now and then (the engine's `prefix-hashes`
command) to repair any drift (a lost write, a Redis restart).
Router side: cached_prefix_blocks() counts how many leading blocks of a prompt an
engine holds, and how many of those are on its GPU.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from kvops import live

log = logging.getLogger(__name__)

INDEX_KEY = "kvops:prefix:{engine}"  # the GPU pool's cached blocks
CPU_INDEX_KEY = "kvops:prefix-cpu:{engine}"  # the CPU tier's
RESYNC_S = 30.0


class PrefixIndex:
    def __init__(self, engine_name: str, source: Any) -> None:
        # (set key, the prefix_changes keys that feed it, the prefix-hashes pool)
        self.tiers = [(INDEX_KEY.format(engine=engine_name), "stored", "evicted", "gpu"),
                      (CPU_INDEX_KEY.format(engine=engine_name), "cpu_stored", "cpu_evicted",
                       "cpu")]
        self.source = source  # sends the engine commands (EngineService, EngineCoreClient)
        self._last_full = float("-inf")

    def apply(self, changes: dict) -> None:
        """One feed item's prefix changes (see engine.kv_feed.prefix_changes)."""
        if not (changes["cleared"] or any(changes[stored] or changes[evicted]
                                          for _, stored, evicted, _ in self.tiers)):
            return
        try:
            pipe = live.redis_client().pipeline(transaction=False)
            for key, stored, evicted, _ in self.tiers:
                if changes["cleared"]:
                    pipe.delete(key)
                if changes[stored]:
                    pipe.sadd(key, *changes[stored])
                if changes[evicted]:
                    pipe.srem(key, *changes[evicted])
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
            hashes = {pool: self.source.command("prefix-hashes", {"pool": pool})
                      for _, _, _, pool in self.tiers}
            pipe = live.redis_client().pipeline(transaction=True)
            for key, _, _, pool in self.tiers:
                pipe.delete(key)
                for i in range(0, len(hashes[pool]), 10_000):
                    pipe.sadd(key, *hashes[pool][i:i + 10_000])
            pipe.execute()
        except Exception as e:  # the engine or Redis busy or away: try again soon
            log.warning("prefix index rewrite failed: %s", e)
            self._last_full = now - RESYNC_S + 1.0


def cached_prefix_blocks(engine_name: str, short_hashes: list[str]) -> tuple[int, int]:
    """How many leading blocks of this hash chain the engine has cached, on its GPU or
    its CPU tier (a prompt's lookup goes on from the one into the other), and how many
    of the first of those are on the GPU."""
    if not short_hashes:
        return 0, 0
    pipe = live.redis_client().pipeline(transaction=False)
    pipe.smismember(INDEX_KEY.format(engine=engine_name), short_hashes)
    pipe.smismember(CPU_INDEX_KEY.format(engine=engine_name), short_hashes)
    on_gpu, on_cpu = pipe.execute()
    held = gpu = 0
    for g, c in zip(on_gpu, on_cpu):
        if not (g or c):
            break
        held += 1
        gpu += bool(g) and gpu == held - 1  # still in the GPU's leading run
    return held, gpu


def expect(engine_name: str, short_hashes: list[str]) -> None:
    """Add hashes a job routed to the engine is about to cache."""
    if short_hashes:
        live.redis_client().sadd(INDEX_KEY.format(engine=engine_name), *short_hashes)
