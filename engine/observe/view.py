"""The engine's KV state mirrored off its loop thread, and the deltas between two states
(the dashboard's live data; the wire format is described in docs/live-protocol.md).

`Capturer.capture()` runs on the engine's loop thread and asks the engine for an export
(engine/kv/export.py): values its owners build and hand over (request rows, each table's
block ids, pins and the hash map when due), which nobody changes afterwards. `KVMirror.apply()`
runs on the feed thread (engine/observe/feed.py): it turns an export into per-block numpy
arrays, diffs them with the previous ones and returns the delta. `KVMirror.snapshot()` is
the one builder of the snapshot document: for the live view, the timeline's keyframes and
engine.snapshot() (a mirror fed one full export).

The prefix-cache map and the pins are followed through the engine's KV events
(BlockStored, BlockEvicted, AllBlocksCleared, Pinned, Unpinned). A full scan of the pool,
every FULL_SCAN_S and whenever events are off, corrects the mirror if an event was ever
missed, and says so in the log.
"""
from __future__ import annotations

import logging
import time
from dataclasses import fields
from typing import Any, Protocol

import numpy as np

from engine.kv.events import KVEvent
from engine.kv.export import REQUEST_FIELDS, KVExport, PoolExport
from engine.observe.snapshot import BLOCK_STATES, CACHED, FREE, PINNED, USED, \
    encode_array
from engine.observe.tenants import tenant32



class Exportable(Protocol):
    """What a capture asks of an engine (LLMEngine is one): its events since the last
    capture, whether it keeps any, and an export of its KV state."""
    config: Any  # EngineConfig: max_pending_events > 0 when events are kept

    def take_events(self) -> list[KVEvent]: ...

    def export_kv(self, events: list[KVEvent], full_scan: bool, pins: bool) -> KVExport: ...

_INDEX = REQUEST_FIELDS.index("index")
_COMPUTED = REQUEST_FIELDS.index("num_computed_tokens")
_OUTPUT = REQUEST_FIELDS.index("num_output_tokens")  # right after _COMPUTED (_only_progress)
PIN_EVENTS = frozenset({"Pinned", "Unpinned", "AllBlocksCleared"})
FULL_SCAN_S = 5.0  # how often the hash map and pins are read whole (a safety net)
EVENT_MAX_BLOCKS = 16  # block ids kept per event on the wire and in the history
# What the page and the history keep of an event: not its group (said when not 0), nor
# the full hashes and tokens (for the vLLM-format publisher only)
_EVENT_FIELDS = tuple(f.name for f in fields(KVEvent)
                      if f.name not in ("group", "hashes", "parents", "token_ids", "tenant"))
log = logging.getLogger(__name__)


class Capturer:
    """Takes captures (engine exports, engine/kv/export.py) on the loop thread. Reading
    the whole hash map and every block's pin costs milliseconds at 65,536 blocks, so it
    happens every FULL_SCAN_S (and at each capture when the engine keeps no events);
    pins also after a pin event."""

    def __init__(self, full_scan_s: float = FULL_SCAN_S) -> None:
        self.full_scan_s = full_scan_s
        self._last_scan = float("-inf")

    def capture(self, engine: Exportable) -> KVExport:
        events = engine.take_events()
        events_on = engine.config.max_pending_events > 0
        now = time.monotonic()
        full = now - self._last_scan >= self.full_scan_s or not events_on
        if full:
            self._last_scan = now
        pins = full or any(e.type in PIN_EVENTS for e in events)
        return engine.export_kv(events, full_scan=full, pins=pins)


def event_record(event: KVEvent) -> dict:
    """An event as the page and the history keep it: block lists cut to
    EVENT_MAX_BLOCKS entries, `num_blocks` telling how many there were."""
    record = {name: getattr(event, name) for name in _EVENT_FIELDS}
    num_blocks = len(event.block_ids)
    record["num_blocks"] = num_blocks
    if event.group:
        record["group"] = event.group
    if num_blocks > EVENT_MAX_BLOCKS:
        for name in ("block_ids", "block_hashes", "ref_cnts"):
            if isinstance(record.get(name), list):
                record[name] = record[name][:EVENT_MAX_BLOCKS]
    return record


class PoolMirror:
    """Per-block arrays of one pool (format of engine.snapshot) and its block tables."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.state = np.zeros(num_blocks, dtype=np.uint8)
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self.owner = np.zeros(num_blocks, dtype=np.int32)  # first holder's request index
        self.hash32 = np.zeros(num_blocks, dtype=np.uint32)
        # a cached block's tenant (engine/observe/tenants.py tenant32 of the label of the
        # request that computed it; 0 where not cached or not known), from BlockStored
        # events and the full scans
        self.tenant32 = np.zeros(num_blocks, dtype=np.uint32)
        # request index ((index, group): a hybrid model's other layer groups) -> its block
        # ids (the export's read-only arrays), in export order
        self.tables: dict[int | tuple[int, int], np.ndarray] = {}
        self.pinned = np.zeros(0, dtype=np.int64)
        # The prefix-cache map as events and scans tell it (hash32 is 0 where not hashed).
        self._hashed = np.zeros(num_blocks, dtype=bool)
        self._hash32 = np.zeros(num_blocks, dtype=np.uint32)
        self._tenant32 = np.zeros(num_blocks, dtype=np.uint32)
        self._scanned = False
        self.drift = 0  # full scans that found the event-kept map wrong

    def arrays(self) -> dict[str, np.ndarray]:
        return {"state": self.state, "ref_cnt": self.ref_cnt, "owner": self.owner,
                "hash32": self.hash32, "tenant32": self.tenant32}

    def table_ids(self, index: int) -> list[int]:
        table = self.tables.get(index)
        return [] if table is None else table.tolist()

    def apply(self, cap: PoolExport, events: list[KVEvent],
              events_on: bool = True) -> tuple[dict | None, dict | None]:
        """Take in an export and the events since the last one (events_on: the engine
        keeps events). Returns (changed blocks, table changes), None for no change."""
        table_ops = self._apply_tables(cap.tables)
        if cap.pinned is not None:
            self.pinned = np.asarray(cap.pinned, dtype=np.int64)
        self._follow_events(events)
        if cap.cached is not None:
            self._scan_hashes(cap.cached, verify=events_on)
            self._tenant32[:] = 0
            if cap.tenants:
                ids = np.fromiter(cap.tenants, np.int64, len(cap.tenants))
                self._tenant32[ids] = [tenant32(t) for t in cap.tenants.values()]
        state, ref_cnt, owner, hash32, tenant = self._arrays()
        changed = np.flatnonzero((state != self.state) | (ref_cnt != self.ref_cnt)
                                 | (owner != self.owner) | (hash32 != self.hash32)
                                 | (tenant != self.tenant32))
        self.state, self.ref_cnt, self.owner, self.hash32, self.tenant32 = \
            state, ref_cnt, owner, hash32, tenant
        if changed.size == 0:
            return None, table_ops
        blocks = {"ids": _gaps(changed.tolist()), "state": state[changed].tolist(),
                  "ref_cnt": ref_cnt[changed].tolist(), "owner": owner[changed].tolist(),
                  "hash32": hash32[changed].tolist(), "tenant32": tenant[changed].tolist()}
        return blocks, table_ops

    def _apply_tables(self, exported: list[tuple]) -> dict | None:
        """Table changes for the page: its requests' tables (a hybrid model's other
        layer groups' tables are kept for owners, not sent). A table the exporter did not
        convert again is the same array; one that grew starts with the old ids."""
        appended, replaced = [], []
        tables: dict[int | tuple[int, int], np.ndarray] = {}
        for index, ids in exported:
            old = self.tables.get(index)
            tables[index] = ids
            if old is ids or type(index) is not int:  # (a layer group's: kept, not sent)
                continue
            if old is not None and len(ids) > len(old) and np.array_equal(ids[:len(old)], old):
                appended.append([index, *ids[len(old):].tolist()])
            elif old is None or not np.array_equal(old, ids):
                replaced.append([index, *ids.tolist()])
        replaced += [[index] for index in self.tables
                     if index not in tables and type(index) is int]
        self.tables = tables
        if not appended and not replaced:
            return None
        return {"append": appended, "set": replaced}

    def _follow_events(self, events: list[KVEvent]) -> None:
        for e in events:
            if e.pool != self.name and e.type != "AllBlocksCleared":  # (a reset: every pool)
                continue
            if e.type == "BlockStored":
                who = tenant32(e.tenant) if e.tenant is not None else 0
                for block_id, short_hash in zip(e.block_ids, e.block_hashes):
                    self._hashed[block_id] = True
                    self._hash32[block_id] = int(short_hash[:8], 16) if short_hash else 0
                    self._tenant32[block_id] = who
            elif e.type == "BlockEvicted":
                self._hashed[e.block_ids] = False
                self._hash32[e.block_ids] = 0
                self._tenant32[e.block_ids] = 0
            elif e.type == "AllBlocksCleared":
                self._hashed[:] = False
                self._hash32[:] = 0
                self._tenant32[:] = 0

    def _scan_hashes(self, cached: dict, verify: bool) -> None:
        hashed = np.zeros(self.num_blocks, dtype=bool)
        hash32 = np.zeros(self.num_blocks, dtype=np.uint32)
        if cached:
            ids = np.fromiter(cached.values(), np.int64, len(cached))
            size = len(next(iter(cached)))
            digests = np.fromiter(cached, dtype=f"S{size}", count=len(cached))
            hashed[ids] = True
            hash32[ids] = np.ascontiguousarray(
                digests.view(np.uint8).reshape(len(cached), size)[:, :4]).view(">u4").ravel()
        if verify and self._scanned and not np.array_equal(hash32, self._hash32):
            self.drift += 1
            log.warning("%s pool: the prefix-cache map kept from KV events differed from the "
                        "engine's at %d blocks (an event was missed); corrected",
                        self.name, int(np.count_nonzero(hash32 != self._hash32)))
        self._hashed, self._hash32 = hashed, hash32
        self._scanned = True

    def _arrays(self) -> tuple[np.ndarray, ...]:
        n = self.num_blocks
        parts = list(self.tables.values())
        all_ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        holders = np.bincount(all_ids, minlength=n).astype(np.int32)
        owner = self._owners(all_ids, parts, holders)
        hashed, hash32 = self._hashed, self._hash32.copy()
        tenant = self._tenant32.copy()
        ref_cnt = holders
        ref_cnt[self.pinned] += 1  # a pin holds one reference
        state = np.where(ref_cnt > 0, USED, FREE).astype(np.uint8)
        state[hashed & (ref_cnt == 0)] = CACHED
        state[self.pinned] = PINNED
        return state, ref_cnt, owner, hash32, tenant

    def _owners(self, all_ids: np.ndarray, parts: list[np.ndarray],
                holders: np.ndarray) -> np.ndarray:
        """Each block's first holder (request index) in table order, 0 for none."""
        owner = np.zeros(self.num_blocks, dtype=np.int32)
        if not all_ids.size:
            return owner
        lengths = np.fromiter((len(p) for p in parts), np.int64, len(parts))
        keys = (k if type(k) is int else k[0] for k in self.tables)  # (index, group): index
        owners = np.repeat(np.fromiter(keys, np.int32, len(self.tables)), lengths)
        owner[all_ids] = owners  # exact where one request holds the block
        shared = np.flatnonzero(holders[all_ids] > 1)  # the rest: first in table order
        if shared.size:
            order = np.argsort(all_ids[shared], kind="stable")
            ids = all_ids[shared][order]
            first = np.ones(ids.size, dtype=bool)
            first[1:] = ids[1:] != ids[:-1]
            owner[ids[first]] = owners[shared[order[first]]]
        return owner


class KVMirror:
    """All the dashboard knows about one engine, and the sequence number of its state."""

    def __init__(self, engine: str, epoch: str, config: dict) -> None:
        self.engine = engine
        self.epoch = epoch  # changes when the worker restarts: clients then resync
        self.config = config
        self.seq = 0  # of the last delta; a snapshot carries the seq it is current at
        self.ts = 0.0
        self.step = 0
        self.version = -1
        self.gpu = PoolMirror("gpu", config["num_gpu_blocks"])
        self.cpu = PoolMirror("cpu", config["num_cpu_blocks"])
        self.requests: dict[int, tuple] = {}  # index -> REQUEST_FIELDS row, snapshot order
        self.eviction_order: list[int] = []
        self.metrics: dict = {}

    def apply(self, cap: KVExport) -> dict:
        """Take in an export; the delta from the previous state (seq incremented)."""
        self.seq += 1
        self.ts, self.step, self.version = cap.ts, cap.step, cap.version
        delta: dict = {"type": "delta", "engine": self.engine, "epoch": self.epoch,
                       "seq": self.seq, "ts": cap.ts, "step": cap.step}
        tables = {}
        for name, pool, pool_cap in (("gpu", self.gpu, cap.gpu), ("cpu", self.cpu, cap.cpu)):
            blocks, ops = pool.apply(pool_cap, cap.events, cap.events_on)
            if blocks is not None:
                delta[name] = blocks
            if ops is not None:
                tables[name] = ops
        if tables:
            delta["tables"] = tables
        requests = self._apply_requests(cap.requests)
        if requests:
            delta["requests"] = requests
        if cap.eviction_order != self.eviction_order:
            self.eviction_order = cap.eviction_order
            delta["eviction_order"] = cap.eviction_order
        self.metrics = cap.metrics
        delta["metrics"] = cap.metrics
        return delta

    def _apply_requests(self, rows: list[tuple]) -> dict:
        new = {row[_INDEX]: row for row in rows}
        upsert, progress = [], []
        for index, row in new.items():
            old = self.requests.get(index)
            if old == row:
                continue
            if old is not None and _only_progress(old, row):
                progress.append((index, row[_COMPUTED] - old[_COMPUTED],
                                 row[_OUTPUT] - old[_OUTPUT]))
            else:
                upsert.append(dict(zip(REQUEST_FIELDS, row)))
        removed = [index for index in self.requests if index not in new]
        self.requests = new
        out: dict = {}
        if upsert:
            out["upsert"] = upsert
        if removed:
            out["removed"] = removed
        if progress:
            out["progress"] = _progress_columns(progress)
        return out

    def entry(self, row: tuple) -> dict:
        entry = dict(zip(REQUEST_FIELDS, row))
        entry["block_table"] = self.gpu.table_ids(row[_INDEX])
        entry["cpu_block_table"] = self.cpu.table_ids(row[_INDEX])
        return entry

    def request_entry(self, request_id: str) -> dict | None:
        """One request's row with its tables and, per GPU block of its table, the first
        4 bytes of the block's hash as hex (None: not hashed yet): what its owner may see
        of its blocks (a job's page)."""
        for row in self.requests.values():
            if row[0] == request_id:
                entry = self.entry(row)
                hashes = self.gpu.hash32[entry["block_table"]].tolist()
                entry["block_hashes"] = [f"{h:08x}" if h else None for h in hashes]
                return entry
        return None

    def snapshot(self, compact: bool = True) -> dict:
        """The whole state (the snapshot format of docs/design.md, with type and epoch):
        the one builder of the document, for the live view, the timeline's keyframes and
        engine.snapshot(). compact: per-block arrays as base64 of their bytes."""
        return {
            "type": "snapshot", "engine": self.engine, "epoch": self.epoch, "seq": self.seq,
            "ts": self.ts, "step": self.step, "block_states": list(BLOCK_STATES),
            "config": self.config,
            "gpu": {k: encode_array(v, compact) for k, v in self.gpu.arrays().items()},
            "cpu": {k: encode_array(v, compact) for k, v in self.cpu.arrays().items()},
            "requests": [self.entry(row) for row in self.requests.values()],
            "eviction_order": self.eviction_order,
            "metrics": self.metrics,
        }


def _only_progress(old: tuple, new: tuple) -> bool:
    """Nothing but the token counts changed (the common case, sent compactly)."""
    return old[:_COMPUTED] == new[:_COMPUTED] and old[_OUTPUT + 1:] == new[_OUTPUT + 1:]


def _progress_columns(progress: list[tuple[int, int, int]]) -> dict:
    """Token counts that grew, as three columns: `index` gap-encoded (see _gaps),
    `computed` and `output` as increments."""
    progress.sort()
    return {"index": _gaps([p[0] for p in progress]), "computed": [p[1] for p in progress],
            "output": [p[2] for p in progress]}


def _gaps(ascending: list[int]) -> list[int]:
    """[5, 6, 7, 20] -> [5, 1, 1, 13]: runs of neighbours become runs of 1s, which
    compress to almost nothing."""
    out, prev = [], 0
    for value in ascending:
        out.append(value - prev)
        prev = value
    return out
