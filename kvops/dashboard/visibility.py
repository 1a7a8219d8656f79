"""What a viewer may see of an engine's KV state: the one place that decides it.

Staff see everything. A plain user sees every block's state, reference count and owner
(a request index), every request's counts and status, and the events, but no other
tenant's label and no block hash of anyone's. Tenant labels: their own requests carry
theirs, every other request (another user's, or staff's) `others` (OTHERS), which the
page shows as "another user's"; the KV held by tenant (metrics' `kv_by_tenant`) names
their own tenant and adds up everyone else's as `other`. Hashes: with a hash and a guess of a prompt's first
blocks, anyone who can compute the chain can test the guess (docs/security.md). Their
own requests' hashes are on their own job (the job websocket's `blocks`); token ids
never reach the engine's views, and the text of a hovered block's tokens (the engine's
answer to `block`) only for their own requests (block_facts_for). The sealing applies to every way the state leaves the
service: the snapshot (REST and websocket), the live deltas, the event history (REST and
websocket) and the timeline.

An engine's configuration (its registered config, and the snapshot's) reaches a plain
user without addresses and filesystem paths (plain_config).

Deltas and snapshots travel as zlib JSON encoded once for everyone; a plain viewer's
copy is sealed once per process, frame and tenant (an LRU shared by all of them).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from engine.observe.feed import decode, encode
from engine.observe.snapshot import decode_array, encode_array
from engine.observe.tenants import OTHERS_TENANT, added_up, tenant32
from kvops.routing import tenancy

# Per-block arrays and event fields that carry prefix-cache hashes
HASH_ARRAYS = ("hash32",)
HASH_EVENT_FIELDS = ("block_hashes",)
POOLS = ("gpu", "cpu")
# What a plain user may read of an engine's config (describe_config): sizes, policies and
# formats the pages show. An allow-list, not a list of what to hide: a field the engine
# adds later (an address, a path, a key) stays staff's until it is named here. Left out
# now: migration_address, disk_cache_dir, model_path, tokenizer_path, kv_cache_scales (a
# file); `model` is given as its name, not its path.
PLAIN_CONFIG_FIELDS = (
    "block_size", "num_gpu_blocks", "num_cpu_blocks", "dtype", "device", "max_model_len",
    "vocab_size", "max_num_seqs", "max_num_batched_tokens", "preemption_mode",
    "scheduling_policy", "enable_prefix_caching", "cpu_prefix_cache", "eviction_policy",
    "pin_budget", "disk_cache_bytes", "kv_bytes_per_block", "kv_cache_dtype", "kv_format",
    "simulate", "sliding_window", "kv_group_windows", "tensor_parallel_size", "role",
    "rank_memory")
_FRAMES_KEPT = 64
OTHERS = OTHERS_TENANT  # every tenant label but a plain viewer's own, as that viewer sees it


def sees_everything(user) -> bool:
    """Staff see every hash; a plain user none but their own requests'."""
    return bool(getattr(user, "is_staff", False))


def viewer_tenant(user) -> str | None:
    """The tenant label of `user`'s requests (None: staff, or nobody)."""
    return tenancy.tenant(user) if user is not None else None


def plain_config(config: dict | None) -> dict:
    """An engine's config as a plain user may read it: PLAIN_CONFIG_FIELDS, and the
    model's name."""
    from kvops.selectors import config_model_name  # (a reader of the engines' rows)
    config = config or {}
    out = {k: config[k] for k in PLAIN_CONFIG_FIELDS if k in config}
    out["model"] = config_model_name(config)
    return out


def config_for(config: dict | None, viewer) -> dict:
    """An engine's config as `viewer` may read it."""
    return (config or {}) if sees_everything(viewer) else plain_config(config)


def block_facts_for(facts: dict | None, viewer) -> dict | None:
    """An engine's answer about one block (LLMEngine.block_facts) as `viewer` may read
    it: the text of a holder's tokens for staff and for the holder's own tenant; every
    other holder's text None (its token range, like the snapshot's tables, stays)."""
    if facts is None or sees_everything(viewer):
        return facts
    mine = viewer_tenant(viewer)
    holders = [h if _is_mine(h.get("tenant"), mine) else {**h, "text": None, "tenant": OTHERS}
               for h in facts.get("holders", ())]
    return {**facts, "holders": holders}


def _is_mine(label: str | None, mine: str | None) -> bool:
    return mine is not None and label == mine


def _sealed_request(row: dict, mine: str | None) -> dict:
    return row if _is_mine(row.get("tenant"), mine) else {**row, "tenant": OTHERS}


def metrics_for(metrics: dict | None, viewer) -> dict | None:
    """An engine's metrics as `viewer` may read them."""
    if metrics is None or sees_everything(viewer):
        return metrics
    return seal_metrics(metrics, viewer_tenant(viewer))


def seal_metrics(metrics: dict, mine: str | None) -> dict:
    """Metrics whose KV held by tenant (`kv_by_tenant`, engine/observe/tenants.py) names
    the viewer's tenant alone; everyone else's added up as `other`, without saying how
    many they are. A viewer's tenant outside the engine's top ones is in the engine's
    `other` (which holds no names): `mine_in_other` says so, and the page says it."""
    by_tenant = metrics.get("kv_by_tenant")
    if not isinstance(by_tenant, dict):
        return metrics
    rows = by_tenant.get("tenants") or []
    own = [r for r in rows if _is_mine(r.get("tenant"), mine)]
    rest = [r for r in rows if not _is_mine(r.get("tenant"), mine)]
    if by_tenant.get("other"):
        rest.append(by_tenant["other"])
    other = {**added_up(rest), "tenants": None} if rest else None
    mine_in_other = mine is not None and not own and bool(by_tenant.get("other"))
    return {**metrics, "kv_by_tenant": {"tenants": own, "other": other,
                                         "mine_in_other": mine_in_other}}


def seal_tenants(values, mine: str | None):
    """A per-block `tenant32` array (a delta's list, or a snapshot's encoded array) as a
    plain viewer reads it: their own tenant's key kept, every other tenant's the key of
    OTHERS, 0 (nobody's) kept."""
    own, others = (tenant32(mine) if mine is not None else -1), tenant32(OTHERS_TENANT)
    if isinstance(values, list):
        return [v if v == 0 or v == own else others for v in values]
    array = decode_array(values)
    sealed = np.where((array == 0) | (array == own), array, others).astype(array.dtype)
    return encode_array(sealed, compact=True)


def seal_event(record: dict) -> dict:
    """An event record without its hashes (a copy if it had any)."""
    if not any(record.get(name) for name in HASH_EVENT_FIELDS):
        return record
    return {**record, **{name: [] for name in HASH_EVENT_FIELDS if name in record}}


def seal_events(records: list[dict]) -> list[dict]:
    return [seal_event(r) for r in records]


def seal_document(doc: dict, mine: str | None) -> dict:
    """A snapshot or a delta (decoded) as a plain viewer whose tenant label is `mine` may
    have it: no hash arrays, events without hashes, the config without addresses and
    paths, no other tenant's label (in the requests and the metrics), and `sealed: true`
    so that the page says why."""
    out = dict(doc)
    requests = out.get("requests")
    if isinstance(requests, list):  # a snapshot's rows
        out["requests"] = [_sealed_request(r, mine) for r in requests]
    elif isinstance(requests, dict) and requests.get("upsert"):  # a delta's
        out["requests"] = {**requests,
                           "upsert": [_sealed_request(r, mine) for r in requests["upsert"]]}
    if isinstance(out.get("metrics"), dict):
        out["metrics"] = seal_metrics(out["metrics"], mine)
    if isinstance(out.get("config"), dict):
        out["config"] = plain_config(out["config"])
    for pool in POOLS:
        arrays = out.get(pool)
        if not isinstance(arrays, dict):
            continue
        arrays = {k: v for k, v in arrays.items() if k not in HASH_ARRAYS}
        if "tenant32" in arrays:
            arrays["tenant32"] = seal_tenants(arrays["tenant32"], mine)
        out[pool] = arrays
    if isinstance(out.get("events"), list):
        out["events"] = seal_events(out["events"])
    out["sealed"] = True
    return out


class FrameSealer:
    """Sealed copies of encoded frames, each made once per process and tenant: every
    plain viewer of an engine with the same tenant label receives the same deltas."""

    def __init__(self, kept: int = _FRAMES_KEPT) -> None:
        self.kept = kept
        # by the frame's bytes and the viewer's tenant label
        self._frames: OrderedDict[tuple[bytes, str | None], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.num_sealed = 0  # frames decoded and encoded again (not from the cache)

    def seal(self, data: bytes, mine: str | None) -> bytes:
        key = (data, mine)
        with self._lock:
            sealed = self._frames.get(key)
            if sealed is not None:
                self._frames.move_to_end(key)
                return sealed
        sealed = encode(seal_document(decode(data), mine), level=1)
        with self._lock:
            self.num_sealed += 1
            self._frames[key] = sealed
            while len(self._frames) > self.kept:
                self._frames.popitem(last=False)
        return sealed


frames = FrameSealer()  # this process's
