"""KV events: what happened to blocks and requests, for the dashboard's event log
and for a router that mirrors an engine's prefix cache."""
from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass, field

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


@dataclass(slots=True)
class KVEvent:
    type: str  # one of EVENT_TYPES
    step: int  # engine step during or after which it happened
    ts: float  # wall-clock seconds
    request_id: str | None = None
    pool: str = "gpu"  # "gpu" or "cpu": which pool block_ids refer to
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)  # short hex, same order as block_ids
    ref_cnts: list[int] = field(default_factory=list)  # after the event, same order
    num_tokens: int | None = None  # tokens covered (hits, stored prefix)
    detail: str | None = None  # reason or extra words (e.g. finish reason, "operator")
    # A hybrid model's layer group (engine/hybrid_kv.py) whose block table the blocks are
    # in; 0: the global layers' group, or the only one. Its hashes are the group's own.
    group: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


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
    any subscriber (e.g. a prefix-cache index). No reader, no cost."""

    def __init__(self, maxlen: int) -> None:
        self.step = 0  # owned by LLMEngine: the step now running
        # With a vLLM-format publisher (engine/kv_events_zmq.py): the prefix cache's
        # changes with full hashes and token ids, as ("stored", hashes, parent hash,
        # token ids), ("removed", hashes) or ("cleared",); the CPU tier's records end
        # with the medium "CPU". None: nobody wants them.
        self.external: list[tuple] | None = None
        self._queues: list[EventQueue] = []
        self._default = self.subscribe(maxlen) if maxlen > 0 else None

    def subscribe(self, maxlen: int = 100_000) -> EventQueue:
        queue = EventQueue(maxlen)
        self._queues.append(queue)
        return queue

    def emit(self, type: str, **fields) -> None:
        if not self._queues:
            return
        event = KVEvent(type=type, step=self.step, ts=time.time(), **fields)
        for queue in self._queues:
            queue.push(event)

    def take(self) -> list[KVEvent]:
        return self._default.take() if self._default is not None else []
