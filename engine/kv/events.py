"""KV events: what happened to blocks and requests, as one typed stream.

Every fact is emitted once, where it happens: the block pool (blocks leaving the prefix
cache), the layer groups of the KV core (blocks stored, requests' blocks released), the
prefix tier (blocks stored on the CPU tier), the coordinator (prefix hits, resets, pins)
and the scheduler (preemptions, swaps, ends). Readers subscribe: the dashboard's capture
(engine/observe/view.py), the stored history, and the vLLM-format publisher
(engine/observe/vllm_events.py), whose KVEventBatch is a translation of this stream.

Removals and preemptions carry a `reason` (REASONS) and, where one is known, who caused
them (`by`: the request the blocks were taken for, the request that outranked, an
operator).
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_hash import BlockHash

EVENT_TYPES = (
    "BlockStored",  # blocks registered in the prefix cache (hashes now findable)
    "BlockRemoved",  # a request released blocks (ref counts after the release)
    "BlockEvicted",  # cached hashes left the cache (slot reused, operator evict)
    "PrefixHit",  # a request found cached blocks at admission or swap-in
    "Preempted",  # a request lost its GPU blocks and will recompute
    "SwappedOut",  # GPU blocks copied to the CPU pool and freed
    "SwappedIn",  # CPU blocks copied back to the GPU pool
    "AllBlocksCleared",  # the prefix cache was reset
    "Pinned",  # blocks pinned (one reference held by the pin)
    "Unpinned",
    "Finished",  # a request ended (finish reason in detail)
    "Forked",  # a request with n > 1 became its n samples, sharing its blocks
    "CopiedOnWrite",  # a sample copied the shared, partly filled block it was to write
    "WindowFreed",  # a request gave back blocks no layer's sliding window reaches any more
)

# Why blocks left the cache or a request, or why a request was preempted (a request's
# BlockRemoved says its finish reason, "forked", or its preemption's reason):
REASONS = {
    "evicted": "taken for another request's new blocks, least recently used first",
    "operator_evict": "an operator's evict",
    "reset": "the prefix cache was reset",
    "step_failed": "the step that was to write them failed",
    "window": "no layer's sliding window reaches them any more",
    "kv_full": "the GPU pool had no free block for a running request",
    "priority": "a request of higher priority needed the blocks",
    "fairness": "a tenant served fewer tokens (fairness vtc) needed the seat or the blocks",
    "cache_quota": "its tenant's running requests needed blocks another tenant keeps "
                   "under its cache quota, and it is the newest",
    "operator": "an operator's command",
    "migration": "the request moved to another engine",
    "corrupt": "a disk tier block failed its checks (its file not opened by the disk key, "
               "or not a regular file)",
}


@dataclass(slots=True)
class KVEvent:
    type: str  # one of EVENT_TYPES
    step: int  # engine step during or after which it happened
    ts: float  # wall-clock seconds
    request_id: str | None = None
    pool: str = "gpu"  # "gpu" or "cpu": which pool block_ids refer to ("disk": no ids)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)  # short hex, same order as block_ids
    ref_cnts: list[int] = field(default_factory=list)  # after the event, same order
    num_tokens: int | None = None  # tokens covered (hits, stored prefix)
    detail: str | None = None  # words for a person (e.g. finish reason, "operator")
    # A hybrid model's layer group (engine/kv/layout.py) whose block table the blocks are
    # in; 0: the global layers' group, or the only one. Its hashes are the group's own.
    group: int = 0
    reason: str | None = None  # a removal's or preemption's cause: a key of REASONS
    by: str | None = None  # who caused it: a request id, or an operator's name
    # A preemption's circumstances: the blocks the request that needed room asked for,
    # the free blocks then, and the computed tokens whose K/V the victim lost
    needed_blocks: int | None = None
    free_blocks: int | None = None
    dropped_tokens: int | None = None
    # Finished, Forked: the request's KV block-seconds here by pool ({"gpu", "cpu"};
    # engine/kv/block_seconds.py)
    block_seconds: dict[str, float] | None = None
    # BlockStored: the tenant whose request computed the blocks (None: staff's, or
    # untold); kept out of the page's event records (a viewer's map reads it sealed)
    tenant: str | None = None
    # For readers that rebuild the prefix cache elsewhere (EventLog.full): the full
    # hashes of block_ids' blocks, and for BlockStored on the GPU each one's parent hash
    # (None: the chain's first) and their token ids, block_size per block
    hashes: list[BlockHash] | None = None
    parents: list[BlockHash | None] | None = None
    token_ids: list[int] | None = None


class EventQueue:
    """One reader's bounded queue of events (the oldest are dropped when it is full)."""

    def __init__(self, maxlen: int) -> None:
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=maxlen)
        self.num_dropped = 0  # events pushed out by the bound before the reader took them

    def push(self, event: KVEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(event)

    def take(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        return out


class EventLog:
    """Fans each event out to every reader's queue: the engine's own (take_events) and
    any subscriber (e.g. the vLLM-format publisher). No reader, no cost."""

    def __init__(self, maxlen: int, clock: Callable[[], float] = time.time) -> None:
        self.step = 0  # owned by LLMEngine: the step now running
        self.clock = clock  # events' `ts`: wall-clock seconds (BlockPool's is for pins)
        # Whether a reader wants the full hashes, parents and token ids (KVEvent's last
        # fields): set by subscribe(full=True); emitters fill them only then.
        self.full = False
        self._queues: list[EventQueue] = []
        self._default = self.subscribe(maxlen) if maxlen > 0 else None

    def subscribe(self, maxlen: int = 100_000, full: bool = False) -> EventQueue:
        queue = EventQueue(maxlen)
        self._queues.append(queue)
        self.full = self.full or full
        return queue

    @property
    def on(self) -> bool:
        """Whether anyone reads events (emitters skip building them otherwise)."""
        return bool(self._queues)

    def emit(self, type: str, **fields) -> None:
        if not self._queues:
            return
        event = KVEvent(type=type, step=self.step, ts=self.clock(), **fields)
        for queue in self._queues:
            queue.push(event)

    def take(self) -> list[KVEvent]:
        return self._default.take() if self._default is not None else []
