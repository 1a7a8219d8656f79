"""A Python client of the live protocol (docs/live-protocol.md), the same steps as
static/kvops/live_sync.js: start from a snapshot, apply deltas in sequence order."""
from __future__ import annotations

import itertools

import numpy as np

from engine.observe.snapshot import decode_array

ARRAYS = ("state", "ref_cnt", "owner", "hash32", "tenant32")


class SequenceGap(Exception):
    """A delta does not follow the last one applied: resync."""


class LiveState:
    def __init__(self, snapshot: dict) -> None:
        self.engine = snapshot["engine"]
        self.epoch = snapshot.get("epoch")
        self.seq = snapshot["seq"]
        # a sealed snapshot (a plain user's) has no hash32: zeros, as the page keeps it
        self.sealed = bool(snapshot.get("sealed"))
        self.pools = {pool: {k: decode_array(snapshot[pool][k]).astype(np.int64).copy()
                             if k in snapshot[pool] else
                             np.zeros_like(decode_array(snapshot[pool]["state"]), np.int64)
                             for k in ARRAYS} for pool in ("gpu", "cpu")}
        self.requests = {r["index"]: dict(r) for r in snapshot["requests"]}
        self.eviction_order = list(snapshot["eviction_order"])
        self.metrics = snapshot["metrics"]
        self.events: list[dict] = []

    def apply(self, delta: dict) -> None:
        if delta.get("epoch") != self.epoch or delta["seq"] != self.seq + 1:
            raise SequenceGap(f"have seq {self.seq}, got {delta['seq']}")
        self.seq = delta["seq"]
        for pool in ("gpu", "cpu"):
            blocks = delta.get(pool)
            if blocks:
                ids = np.fromiter(itertools.accumulate(blocks["ids"]), np.int64)
                for k in ARRAYS:
                    if k in blocks:
                        self.pools[pool][k][ids] = blocks[k]
        self._apply_requests(delta.get("requests", {}))
        for pool, key in (("gpu", "block_table"), ("cpu", "cpu_block_table")):
            ops = delta.get("tables", {}).get(pool)
            if not ops:
                continue
            for index, *ids in ops["append"]:
                self.requests[index][key].extend(ids)
            for index, *ids in ops["set"]:
                if index in self.requests:
                    self.requests[index][key] = list(ids)
        if "eviction_order" in delta:
            self.eviction_order = list(delta["eviction_order"])
        self.metrics = delta["metrics"]
        self.events.extend(delta.get("events", []))

    def _apply_requests(self, changes: dict) -> None:
        for entry in changes.get("upsert", []):
            old = self.requests.get(entry["index"], {"block_table": [], "cpu_block_table": []})
            self.requests[entry["index"]] = {**old, **entry}
        for index in changes.get("removed", []):
            del self.requests[index]
        progress = changes.get("progress")
        if progress:
            indices = itertools.accumulate(progress["index"])
            for index, computed, output in zip(indices, progress["computed"], progress["output"]):
                self.requests[index]["num_computed_tokens"] += computed
                self.requests[index]["num_output_tokens"] += output

    def arrays(self, pool: str) -> dict[str, np.ndarray]:
        return self.pools[pool]

    def request_list(self) -> list[dict]:
        return sorted(self.requests.values(), key=lambda r: r["index"])
