"""The engine side of the live dashboard: KV deltas to the Channels group `engine.<name>`.

`EnginePublisher` is an engine hook. On the loop thread it only takes a capture (copies
of references and counters, see kvops/kv_mirror.py), at most 10 times a second and only
when the engine changed (once a second anyway, for the metrics). Its own thread does
the rest: diff against the mirror, encode, send in sequence-number order, answer the
snapshot and block-table queries of consumers, append KV events and metrics to their
Redis histories, and keep the latest full snapshot in Redis for the REST API.

On the wire a delta or snapshot is zlib-compressed JSON (`encode`), sent as a binary
websocket frame as it is: encoded once here, whatever the number of clients.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import zlib
from dataclasses import dataclass

from channels.exceptions import ChannelFull
from django.conf import settings

from kvops import live
from kvops.kv_mirror import Capture, Capturer, KVMirror, event_record

log = logging.getLogger(__name__)

NOISY_EVENTS = frozenset({"BlockStored", "BlockRemoved", "BlockEvicted"})
WIRE_MAX_EVENTS = 50  # events kept per publish: every kind but churn, up to this many,
WIRE_MAX_NOISY = 8  # and the latest of the block churn
# Redis history lengths (approximate, streams are trimmed lazily); settings may override.
EVENT_HISTORY = 10_000  # KV events per engine
METRICS_HISTORY = 3_600  # metrics points per engine (one a second: an hour)
STORE_SHARE = 0.02  # of wall time, for the REST snapshot (2 MB of JSON at 65,536 blocks)
QUERY_POLL_S = 0.1  # how often the thread looks for consumers' queries when idle


def _setting(name: str, default: int) -> int:
    return int(getattr(settings, name, default))


def encode(doc: dict, level: int = 6) -> bytes:
    """A delta or snapshot as it travels: zlib (RFC 1950) of compact JSON."""
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), level)


def decode(data: bytes) -> dict:
    return json.loads(zlib.decompress(data))


def select_events(events: list) -> tuple[list, dict[str, int]]:
    """The events worth a line in the log: every kind but block churn (up to
    WIRE_MAX_EVENTS), and the latest WIRE_MAX_NOISY churn events; with the count of each
    kind among all of them. Under load the engine emits hundreds of BlockStored a tick:
    nobody reads them one by one, and keeping them all would cost the engine's time."""
    counts: dict[str, int] = {}
    notable, noisy = [], []
    for event in events:
        counts[event.type] = counts.get(event.type, 0) + 1
        (noisy if event.type in NOISY_EVENTS else notable).append(event)
    kept = notable[-WIRE_MAX_EVENTS:] + noisy[-WIRE_MAX_NOISY:]
    kept.sort(key=lambda e: e.ts)
    return kept, counts


@dataclass(slots=True)
class PublisherStats:
    """What publishing costs; read by benchmarks and tests."""
    captures: int = 0
    capture_s: float = 0.0  # on the engine's loop thread
    deltas: int = 0
    publish_s: float = 0.0  # on the publisher thread, wall time: diff, encode, send
    publish_cpu_s: float = 0.0  # the same, CPU time of that thread only (no waiting)
    delta_bytes: int = 0  # compressed, as sent
    snapshots_sent: int = 0
    errors: int = 0


class EnginePublisher:
    def __init__(self, name: str, interval_s: float = 0.1, idle_interval_s: float = 1.0,
                 store_interval_s: float = 1.0, summary_interval_s: float = 0.5,
                 metrics_interval_s: float = 1.0) -> None:
        self.name = name
        self.interval_s = interval_s  # at most 1/interval_s deltas a second
        self.idle_interval_s = idle_interval_s  # a metrics-only delta this often when idle
        self.store_interval_s = store_interval_s
        self.summary_interval_s = summary_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.epoch = uuid.uuid4().hex[:12]
        self.stats = PublisherStats()
        self.mirror: KVMirror | None = None  # publisher thread only, once started
        self._capturer = Capturer()  # loop thread only
        self._last_capture = float("-inf")  # loop thread only
        self._last_version = -1  # loop thread only
        self._lock = threading.Lock()
        self._pending: Capture | None = None  # handed from the loop thread, under _lock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._due = {"store": 0.0, "summary": 0.0, "metrics": 0.0}  # publisher thread only
        self._stored_seq = -1

    # --- the engine's loop thread --------------------------------------------------------
    def __call__(self, engine) -> None:
        now = time.monotonic()
        if self._thread is None:
            self._start(engine.describe_config())
        since = now - self._last_capture
        changed = engine.version != self._last_version
        if since < (self.interval_s if changed else self.idle_interval_s):
            return
        started = time.perf_counter()
        capture = self._capturer.capture(engine)
        self._last_capture, self._last_version = now, capture.version
        with self._lock:
            if self._pending is not None:  # the thread is behind: newest state, every event
                capture.events = self._pending.events + capture.events
            self._pending = capture
        self._wake.set()
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started

    def _start(self, config: dict) -> None:
        self.mirror = KVMirror(self.name, self.epoch, config)
        self._thread = threading.Thread(target=self._run, name=f"kvops-publisher-{self.name}",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(QUERY_POLL_S)
            self._wake.clear()
            with self._lock:
                capture, self._pending = self._pending, None
            try:
                if capture is not None:
                    self._publish(capture)
                if self.mirror.seq > 0:  # nothing to answer with before the first capture
                    self._answer_queries()
                    self._store_snapshot()
            except Exception as e:  # Redis away: clients see a gap and resync later
                self.stats.errors += 1
                log.warning("publishing %s failed: %s", self.name, e)
                self._stop.wait(1.0)

    def _publish(self, capture: Capture) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        delta = self.mirror.apply(capture)
        kept, counts = select_events(capture.events)
        records = [event_record(e) for e in kept]
        live.append_events(self.name, records, _setting("KVOPS_EVENT_HISTORY", EVENT_HISTORY))
        if delta["seq"] > 1:  # the first one has no base: clients start from a snapshot
            delta["events"] = records
            delta["event_counts"] = counts
            data = encode(delta)
            live.group_send_wait(live.engine_group(self.name),
                                 {"type": "engine.delta", "seq": delta["seq"], "data": data})
            self.stats.deltas += 1
            self.stats.delta_bytes += len(data)
        self._send_summary(capture)
        self.stats.publish_s += time.perf_counter() - started
        self.stats.publish_cpu_s += time.thread_time() - cpu

    def _send_summary(self, capture: Capture) -> None:
        now = time.monotonic()
        point = {"ts": capture.ts, "step": capture.step, **capture.metrics}
        if now >= self._due["summary"]:
            self._due["summary"] = now + self.summary_interval_s
            live.group_send_wait(live.engine_summary_group(self.name), {
                "type": "engine.summary", "engine": self.name, "epoch": self.epoch,
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
                        snapshot = encode(self.mirror.snapshot(), level=1)
                    live.channel_send_wait(reply_to, {"type": "engine.snapshot",
                                                      "seq": self.mirror.seq, "data": snapshot})
                    self.stats.snapshots_sent += 1
                elif query.get("kind") == "request":
                    entry = self.mirror.request_entry(str(query.get("request_id")))
                    live.channel_send_wait(reply_to, {
                        "type": "engine.request", "engine": self.name, "seq": self.mirror.seq,
                        "request_id": query.get("request_id"), "request": entry})
            except ChannelFull:  # that client is not reading; the others still get answers
                self.stats.errors += 1
                log.warning("%s: no answer to %s: its channel is full", self.name, reply_to)

    def _store_snapshot(self) -> None:
        """The latest full snapshot for GET /api/engines/<name>/: once a second, or less
        often when building it takes long (at most STORE_SHARE of this thread's time)."""
        now = time.monotonic()
        if now < self._due["store"] or self.mirror.seq == self._stored_seq:
            return
        self._stored_seq = self.mirror.seq
        live.store_snapshot(self.name, self.mirror.snapshot())
        took = time.monotonic() - now
        self._due["store"] = now + max(self.store_interval_s, took / STORE_SHARE)
