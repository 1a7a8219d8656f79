"""The engine's KV state as JSON: what the dashboard draws (format in DESIGN.md)."""
from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING

import numpy as np

from engine.block_pool import BlockPool
from engine.request import Request

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

# Per-block state codes, in the order the snapshot's "block_states" lists them.
BLOCK_STATES = ("free", "used", "cached", "pinned")
FREE, USED, CACHED, PINNED = range(4)
EVICTION_ORDER_LEN = 64  # how many upcoming victims the snapshot lists


def encode_array(values: np.ndarray, compact: bool) -> list[int] | dict:
    """A per-block array: a JSON list, or base64 of its little-endian bytes."""
    if not compact:
        return values.tolist()
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return {"dtype": values.dtype.str, "data": base64.b64encode(values.tobytes()).decode()}


def decode_array(obj: list[int] | dict) -> np.ndarray:
    """Inverse of encode_array (for tests and Python clients)."""
    if isinstance(obj, list):
        return np.asarray(obj, dtype=np.int64)
    return np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))


def pool_arrays(pool: BlockPool, tables: dict[str, list], index_of: dict[str, int],
                group_tables: list = ()) -> dict:
    """state, ref_cnt, owner (first holder's request index, 0 for none), hash32 (first
    4 bytes of the block hash as an integer, 0 for none) for every block. group_tables:
    a hybrid model's other layer groups' (group, tables), whose blocks their requests
    own too."""
    n = pool.num_blocks
    state = np.zeros(n, dtype=np.uint8)
    ref_cnt = np.zeros(n, dtype=np.int32)
    owner = np.zeros(n, dtype=np.int32)
    hash32 = np.zeros(n, dtype=np.uint32)
    for block in pool.blocks:
        if block.ref_cnt:
            ref_cnt[block.block_id] = block.ref_cnt
            state[block.block_id] = PINNED if block.pinned else USED
        elif block.block_hash is not None:
            state[block.block_id] = CACHED
        if block.block_hash is not None:
            hash32[block.block_id] = int.from_bytes(block.block_hash[:4], "big")
    for each in [tables, *(t for _, t in group_tables)]:
        for request_id, table in each.items():
            ids = np.fromiter((b.block_id for b in table), dtype=np.int64, count=len(table))
            unowned = ids[owner[ids] == 0]
            owner[unowned] = index_of[request_id]
    return {"state": state, "ref_cnt": ref_cnt, "owner": owner, "hash32": hash32}


def request_entry(request: Request, engine: LLMEngine) -> dict:
    kv = engine.kv
    return {
        "request_id": request.request_id,
        "index": request.index,
        "job_id": request.job_id,
        "status": request.status.value,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_cached_tokens": request.num_cached_tokens or 0,
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
        "parked": request.parked,
        "arrival_time": request.arrival_time,
        "finish_reason": request.finish_reason,
        "block_table": kv.block_ids(request.request_id),
        # leading blocks given back to the pool (sliding window): block_table starts after them
        "window_freed_blocks": kv.window_freed(request.request_id),
        "cpu_block_table": kv.cpu_block_ids(request.request_id),
        "tenant": request.tenant,  # who asked, as an opaque label (None: staff, or unknown)
    }


def build_snapshot(engine: LLMEngine, compact: bool) -> dict:
    kv = engine.kv
    sched = engine.scheduler
    live = list(sched.requests.values())
    index_of = {r.request_id: r.index for r in live}
    gpu = pool_arrays(kv.gpu, kv.req_to_blocks, index_of, kv.group_tables("gpu"))
    cpu = pool_arrays(kv.cpu, kv.req_to_cpu_blocks, index_of, kv.group_tables("cpu"))
    live_ids = set(index_of)
    finished = [r for r in sched.recently_finished if r.request_id not in live_ids]
    return {
        "engine": engine.config.name,
        "seq": engine.next_snapshot_seq(),
        "ts": time.time(),
        "step": engine.step_count,
        "block_states": list(BLOCK_STATES),
        "config": engine.describe_config(),
        "gpu": {k: encode_array(v, compact) for k, v in gpu.items()},
        "cpu": {k: encode_array(v, compact) for k, v in cpu.items()},
        "requests": [request_entry(r, engine) for r in live + finished],
        "eviction_order": kv.gpu.eviction_order(EVICTION_ORDER_LEN),
        "metrics": engine.metrics(),
    }
