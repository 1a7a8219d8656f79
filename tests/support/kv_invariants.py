"""An engine's KV block invariants as a running stack shows them: the snapshot the engine's
publisher stores (GET /api/engines/<name>/), whose per-block arrays, request tables and
metrics come from one capture. The engine's own check (KVCacheCoordinator.
check_invariants) needs the engine in the test's process; through the snapshot a test
sees the same invariants from outside, and the one a leak breaks: the blocks the pool
counts as held (its `kv_usage`) are the blocks the requests' tables and the pins hold.
Blocks a destination holds for a copy under way are held by no table, so between moves
the two counts agree, and a move that ended without giving its blocks back shows.

Tests of faults wait until `settled` holds on every engine that survived."""
from __future__ import annotations

from collections import Counter

import numpy as np

from engine.observe.snapshot import PINNED, USED, decode_array

LIVE = ("waiting", "running", "swapped")  # a request's statuses that may hold blocks
POOLS = (("gpu", "block_table", "kv_usage", "num_gpu_blocks"),
         ("cpu", "cpu_block_table", "cpu_kv_usage", "num_cpu_blocks"))


def problems(snapshot: dict) -> list[str]:
    """Each invariant the snapshot breaks, in words (none: an empty list)."""
    found = []
    for r in snapshot["requests"]:
        if r["status"] not in LIVE and (r["block_table"] or r["cpu_block_table"]):
            found.append(f"request {r['request_id']} is {r['status']} and still holds blocks")
    for pool, table_key, usage_key, size_key in POOLS:
        found += _pool_problems(snapshot, pool, table_key, usage_key, size_key)
    return found


def _pool_problems(snapshot: dict, pool: str, table_key: str, usage_key: str,
                   size_key: str) -> list[str]:
    num_blocks = snapshot["config"][size_key]
    state = decode_array(snapshot[pool]["state"])
    ref_cnt = decode_array(snapshot[pool]["ref_cnt"])
    if len(state) != num_blocks or len(ref_cnt) != num_blocks:
        return [f"{pool}: {len(state)} states and {len(ref_cnt)} reference counts for "
                f"{num_blocks} blocks"]
    found = []
    holders: Counter[int] = Counter()
    for r in snapshot["requests"]:
        table = r[table_key]
        if len(set(table)) != len(table):
            found.append(f"{pool}: the block table of {r['request_id']} repeats a block")
        holders.update(table)
    expected = np.zeros(num_blocks, dtype=np.int64)
    for block_id, count in holders.items():
        expected[block_id] = count
    expected += state == PINNED  # a pin holds one reference
    wrong = np.flatnonzero(ref_cnt != expected)
    if wrong.size:
        b = int(wrong[0])
        found.append(f"{pool}: block {b} has ref_cnt {int(ref_cnt[b])}, {int(expected[b])} "
                     f"holders ({wrong.size} such blocks)")
    held = (state == USED) | (state == PINNED)
    if not np.array_equal(held, ref_cnt > 0):
        found.append(f"{pool}: a block is used or pinned iff its ref_cnt is above 0")
    pool_held = round(snapshot["metrics"][usage_key] * num_blocks)
    if pool_held != int(held.sum()):
        found.append(f"{pool}: the pool holds {pool_held} blocks, the requests' tables and "
                     f"the pins {int(held.sum())} (the rest is held by nothing: leaked, or "
                     "held for a move under way)")
    return found


def settled(snapshot: dict) -> bool:
    """No request left on the engine, no block held, and every invariant holds."""
    live = [r for r in snapshot["requests"] if r["status"] in LIVE]
    return not live and snapshot["metrics"]["kv_usage"] == 0 and not problems(snapshot)
