"""Which engine holds which cached prefix: an index in Redis for prefix-aware routing.

Worker side: PrefixIndex mirrors the engine's prefix cache into Redis sets of short
block hashes, one for the GPU pool and one for the CPU tier (EngineConfig.
cpu_prefix_cache: a hit there is copied back instead of recomputed), from the prefix
changes its KV feed reports (blocks stored, evicted, the cache cleared;
engine/observe/feed.py), with a full rewrite now and then (the engine's `prefix-hashes`
command) to repair any drift (a lost write, a Redis restart).
Router side: leading_blocks() counts how many leading blocks of a prompt an engine
holds, and how many of those are on its GPU, from reads queued by look_up() (a batch of
jobs routed together reads all its prompts in one round trip).
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
        self.source = source  # sends the engine commands (an engine client)
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
        if not getattr(self.source, "alive", True):
            return  # (loading its model, or gone: the rewrite once it runs repairs the index)
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


def look_up(pipe, engine_name: str, short_hashes: list[str]) -> None:
    """Queue on a pipeline the two membership reads leading_blocks() takes (GPU, then
    CPU tier); nothing for an empty chain."""
    if short_hashes:
        pipe.smismember(INDEX_KEY.format(engine=engine_name), short_hashes)
        pipe.smismember(CPU_INDEX_KEY.format(engine=engine_name), short_hashes)


def leading_blocks(short_hashes: list[str], on_gpu: list, on_cpu: list,
                   expected: set[str] = frozenset()) -> tuple[int, int]:
    """(blocks held, of them on the GPU's leading run) for a chain whose GPU and CPU
    membership was read; `expected`: hashes taken as on the GPU besides (the prefixes
    of jobs routed to the engine a moment ago, which it will cache)."""
    held = gpu = 0
    for h, g, c in zip(short_hashes, on_gpu, on_cpu):
        g = g or h in expected
        if not (g or c):
            break
        held += 1
        gpu += bool(g) and gpu == held - 1  # still in the GPU's leading run
    return held, gpu


def expect(pipe, engine_name: str, short_hashes: list[str] | set[str]) -> None:
    """Queue on a pipeline the addition of hashes that jobs routed to the engine are
    about to cache."""
    if short_hashes:
        pipe.sadd(INDEX_KEY.format(engine=engine_name), *short_hashes)
