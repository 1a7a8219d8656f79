"""The worker side of the live dashboard: the engine's KV feed (engine/observe/feed.py) to the
Channels group `engine.<name>`, Redis histories and the prefix-cache index.

The feed runs where the engine runs (the engine core process, or the worker's engine
thread) and hands over items: an encoded delta, the KV events worth keeping, a metrics
point, the prefix-cache changes. `EnginePublisher` queues them (`on_item`, never
blocking) and its own thread does the I/O, in sequence-number order: deltas to the
group and to the timeline (kvops/dashboard/timeline.py), events and metrics to their Redis
histories, a summary to `engine-summary.<name>`, prefix changes to the routing index. It
answers the consumers' snapshot, block-table and block queries by asking the feed, and keeps the
latest full snapshot in Redis for the REST API (now and then a timeline keyframe too).

On the wire a delta or snapshot is zlib-compressed JSON (`engine.kv_feed.encode`), sent as a binary
websocket frame as it is: encoded once by the feed, whatever the number of clients.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Protocol

from channels.exceptions import ChannelFull
from django.conf import settings

from engine.errors import EngineError
from kvops import live
from kvops.routing.prefix_index import PrefixIndex
from kvops.dashboard.timeline import TimelineWriter, limits_from_settings

log = logging.getLogger(__name__)

# Redis history lengths (approximate, streams are trimmed lazily); settings may override.
EVENT_HISTORY = 10_000  # KV events per engine
METRICS_HISTORY = 3_600  # metrics points per engine (one a second: an hour)
STORE_SHARE = 0.02  # of wall time, for the REST snapshot (2 MB of JSON at 65,536 blocks)
MAX_STORE_GAP_S = 5.0  # the next REST snapshot is stored at most this long after the last ended
QUERY_POLL_S = 0.1  # how often the thread looks for consumers' queries when idle
ASK_TIMEOUT_S = 10.0


def next_store_due(started: float, took: float, interval_s: float) -> float:
    """When the REST snapshot may be stored again after a store that began at `started`
    (monotonic seconds) and took `took`: `interval_s` later, or later still while storing
    is slow, so that storing takes at most STORE_SHARE of the publisher's time, but never
    more than MAX_STORE_GAP_S after that store ended. A store can be slow once while the
    engine core is busy (a large move): paced by that one alone, a store of 0.48 s put the
    next 24 s off, and the stored snapshot kept listing a request that had ended as
    running all that while."""
    return started + max(interval_s, min(took / STORE_SHARE, took + MAX_STORE_GAP_S))


def _setting(name: str, default: int) -> int:
    return int(getattr(settings, name, default))


class KVSource(Protocol):
    """Where the engine's feed runs: an engine client (engine/serve/client.py)."""

    def ask_kv(self, kind: str, argument: Any, timeout_s: float) -> Any: ...


class EnginePublisher:
    def __init__(self, name: str, source: KVSource, prefix_index: PrefixIndex | None = None,
                 store_interval_s: float = 1.0, summary_interval_s: float = 0.5,
                 metrics_interval_s: float = 1.0) -> None:
        """source: where the engine's feed runs (its items come to on_item); prefix_index:
        the routing index the feed's prefix-cache changes go to (a worker's, kept with
        the engine's cached hashes through its commands), if any."""
        self.name = name
        self.store_interval_s = store_interval_s
        self.summary_interval_s = summary_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.prefix_index = prefix_index
        self.source = source
        self.timeline = TimelineWriter(name, limits_from_settings())  # publisher thread only
        self.errors = 0
        self.deltas_sent = 0
        self.last_seq = 0  # of the last item handled
        self._items: collections.deque[dict] = collections.deque()  # from on_item
        self._busy = False  # the thread is handling an item
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._due = {"store": 0.0, "summary": 0.0, "metrics": 0.0}  # publisher thread only
        self._stored_seq = -1
        self._thread = threading.Thread(target=self._run, name=f"kvops-publisher-{name}",
                                        daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Every item handed over so far has been sent."""
        with self._lock:
            return not self._items and not self._busy

    # --- any thread --------------------------------------------------------------------------
    def on_item(self, item: dict) -> None:
        """An item of the engine's feed (never blocks: the I/O happens on our thread)."""
        with self._lock:
            self._items.append(item)
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # --- the publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(QUERY_POLL_S)
            self._wake.clear()
            try:
                while True:
                    with self._lock:
                        if not self._items:
                            break
                        item = self._items.popleft()
                        self._busy = True
                    try:
                        self._publish(item)
                    finally:
                        with self._lock:
                            self._busy = False
                if self.last_seq > 0:  # nothing to answer with before the first item
                    self._answer_queries()
                    self._store_snapshot()
                if self.prefix_index is not None:
                    self.prefix_index.maybe_rewrite()
            except Exception as e:  # Redis away: clients see a gap and resync later
                self.errors += 1
                log.warning("publishing %s failed: %s", self.name, e)
                self._stop.wait(1.0)

    def _publish(self, item: dict) -> None:
        self.last_seq = item["seq"]
        live.append_events(self.name, item["records"],
                           _setting("KVOPS_EVENT_HISTORY", EVENT_HISTORY))
        if item["delta"] is not None:
            live.group_send_wait(live.engine_group(self.name),
                                 {"type": "engine.delta", "seq": item["seq"],
                                  "data": item["delta"]})
            self.deltas_sent += 1
            # (after the live send: the pages never wait for the history)
            self.timeline.add_delta(item["epoch"], item["seq"], item["point"]["ts"], item["delta"])
        if self.prefix_index is not None:
            self.prefix_index.apply(item["prefix"])
        self._send_summary(item)

    def _send_summary(self, item: dict) -> None:
        now = time.monotonic()
        point = item["point"]
        if now >= self._due["summary"]:
            self._due["summary"] = now + self.summary_interval_s
            live.group_send_wait(live.engine_summary_group(self.name), {
                "type": "engine.summary", "engine": self.name, "epoch": item["epoch"],
                "metrics": point})
        if now >= self._due["metrics"]:
            self._due["metrics"] = now + self.metrics_interval_s
            live.append_metrics(self.name, point,
                                _setting("KVOPS_METRICS_HISTORY", METRICS_HISTORY))

    def _answer_queries(self) -> None:
        queries = live.take_engine_queries(self.name)
        snapshot = None
        for query in queries:
            reply_to = query.get("reply_to")
            if not isinstance(reply_to, str):
                continue
            try:
                if query.get("kind") == "snapshot":
                    if snapshot is None:
                        snapshot = self.source.ask_kv("snapshot", None, ASK_TIMEOUT_S)
                    live.channel_send_wait(reply_to, {"type": "engine.snapshot",
                                                      "seq": snapshot["seq"],
                                                      "data": snapshot["data"]})
                elif query.get("kind") == "request":
                    answer = self.source.ask_kv("request", str(query.get("request_id")),
                                                ASK_TIMEOUT_S)
                    live.channel_send_wait(reply_to, {
                        "type": "engine.request", "engine": self.name, "seq": answer["seq"],
                        "request_id": query.get("request_id"), "request": answer["entry"]})
                elif query.get("kind") == "block":
                    live.channel_send_wait(reply_to, self._block(query))
            except ChannelFull:  # that client is not reading; the others still get answers
                self.errors += 1
                log.warning("%s: no answer to %s: its channel is full", self.name, reply_to)

    def _block(self, query: dict) -> dict:
        """The engine's answer about one block (LLMEngine.block_facts), or why none came."""
        asked = {"pool": query.get("pool"), "block_id": query.get("block_id")}
        try:
            facts, error = self.source.ask_kv("block", asked, ASK_TIMEOUT_S), None
        except (LookupError, TimeoutError, EngineError) as e:
            facts, error = None, str(e)
        return {"type": "engine.block", "engine": self.name, **asked, "facts": facts,
                "error": error}

    def _store_snapshot(self) -> None:
        """The latest full snapshot for GET /api/engines/<name>/: once a second, or less
        often when building it takes long (next_store_due); now and then the same
        snapshot is the timeline's next keyframe."""
        now = time.monotonic()
        if now < self._due["store"] or self.last_seq == self._stored_seq:
            return
        self._stored_seq = self.last_seq
        snapshot = self.source.ask_kv("snapshot-doc", None, ASK_TIMEOUT_S)
        live.store_snapshot(self.name, snapshot)
        if self.timeline.keyframe_due():
            self.timeline.add_keyframe(snapshot)
        self._due["store"] = next_store_due(now, time.monotonic() - now, self.store_interval_s)
