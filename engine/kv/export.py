"""What the engine hands its viewers: its KV state as values they may keep and read on
any thread (the dashboard's capture, engine/observe/view.py; engine.snapshot()).

The owners build it, on the engine's loop thread: the scheduler its requests' rows
(Scheduler.export_rows), the KV core its pools' block tables, pins and hash map
(KVCacheCoordinator.export_pool), LLMEngine.export_kv the whole. Nothing in it is a
container the engine goes on changing: rows are tuples, tables read-only arrays, the
hash map a copy. So no viewer reads an owner's state, and the owners may change their
own as they please.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv.events import KVEvent
from engine.request import Request

# A request as the dashboard lists it, in this order (a row is a tuple of these).
REQUEST_FIELDS = ("request_id", "index", "job_id", "status", "num_prompt_tokens",
                  "num_computed_tokens", "num_output_tokens", "num_cached_tokens",
                  "num_preemptions", "num_swaps_out", "priority", "parked", "arrival_time", "finish_reason",
                  "window_freed_blocks", "tenant")


def request_row(r: Request, window_freed: dict[str, int]) -> tuple:
    """One request's REQUEST_FIELDS (window_freed: leading blocks a sliding window gave
    back, by request id; empty for most models)."""
    return (r.request_id, r.index, r.job_id, r.status.value, len(r.prompt_token_ids),
            r.num_computed_tokens, len(r.output_token_ids), r.num_cached_tokens or 0,
            r.num_preemptions, r.num_swaps_out, r.priority, r.parked, r.arrival_time, r.finish_reason,
            window_freed.get(r.request_id, 0) if window_freed else 0, r.tenant)


@dataclass(frozen=True, slots=True)
class PoolExport:
    name: str  # "gpu" or "cpu", as events name pools
    num_blocks: int
    # (key, block ids) per live request's table: key its index, or (index, group) for a
    # hybrid model's layer groups other than 0; ids a read-only int32 array
    tables: list[tuple[int | tuple[int, int], np.ndarray]]
    cached: dict | None  # a copy of the hash -> block map; None: follow the events instead
    pinned: list[int] | None  # ids of pinned blocks; None: not asked for
    # with `cached`: block id -> the tenant whose request computed it (those with one)
    tenants: dict[int, str] | None = None


@dataclass(frozen=True, slots=True)
class KVExport:
    ts: float
    step: int
    version: int  # engine.version when exported
    requests: list[tuple]  # REQUEST_FIELDS rows, in snapshot order
    gpu: PoolExport
    cpu: PoolExport
    eviction_order: list[int]
    metrics: dict
    events: list[KVEvent]  # taken from the engine since the last capture
    events_on: bool = True  # False: the engine keeps no events (max_pending_events=0)
