"""The live KV view of an engine, produced where the engine runs (the engine core
process, or the worker's engine thread): the engine's one capture API for dashboards.

`KVFeed` is a hook on the engine's loop: at most every `interval_s` (every
`idle_interval_s` when nothing changed) it takes a capture (engine/observe/view.py: copies of
references and counters, so a step never waits), and its own thread turns captures into
items that `emit` hands on: the delta, encoded once for every client, the KV events worth
a line in the log, the metrics point, and the prefix-cache changes a router needs. The
mirror it keeps also answers questions (`ask`): the full snapshot, one request's block
tables. Nothing here does I/O: the worker's publisher (kvops/worker/publisher.py) sends items
and answers on.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future
import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.kv.export import KVExport
from engine.observe.view import Capturer, KVMirror, event_record

log = logging.getLogger(__name__)

NOISY_EVENTS = frozenset({"BlockStored", "BlockRemoved", "BlockEvicted"})
WIRE_MAX_EVENTS = 50  # events kept per item: every kind but churn, up to this many,
WIRE_MAX_NOISY = 8  # and the latest of the block churn
ASK_POLL_S = 0.1  # how often the feed thread looks for questions when idle
# Questions only the engine can answer (its evictor's order, when a block was let go),
# answered by the hook on the loop thread between two steps; the others by the mirror
ENGINE_QUESTIONS = frozenset({"block"})


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


PREFIX_CHANGE = {"BlockStored": "stored", "BlockEvicted": "evicted"}  # event -> change


def prefix_changes(events: list) -> dict:
    """What a prefix-cache index must learn from these events: short hashes stored on
    and evicted from the GPU pool and from the CPU tier (cpu_*), and whether the cache
    was cleared (in event order: a clear, which empties both, drops what came before
    it)."""
    changes: dict = {"stored": [], "evicted": [], "cpu_stored": [], "cpu_evicted": [],
                     "cleared": False}
    for e in events:
        if e.type == "AllBlocksCleared":
            changes = {**{k: [] for k in changes}, "cleared": True}
            continue
        kind = PREFIX_CHANGE.get(e.type)
        # (a hybrid model's other layer groups cache under hashes of their own, which
        # no request's prefix hashes name)
        if kind is not None and e.pool in ("gpu", "cpu") and not e.group:
            key = kind if e.pool == "gpu" else f"cpu_{kind}"
            changes[key].extend(h for h in e.block_hashes if h)
    return changes


@dataclass(slots=True)
class FeedStats:
    """What producing the view costs; read by benchmarks and tests."""
    captures: int = 0
    capture_s: float = 0.0  # on the engine's loop thread
    deltas: int = 0
    publish_s: float = 0.0  # on the feed thread, wall time: diff, encode
    publish_cpu_s: float = 0.0  # the same, CPU time of that thread only
    delta_bytes: int = 0  # compressed
    snapshots_sent: int = 0


class KVFeed:
    def __init__(self, name: str, emit: Callable[[dict], None], interval_s: float = 0.1,
                 idle_interval_s: float = 1.0) -> None:
        self.name = name
        self.emit = emit  # called on the feed thread with each item
        self.interval_s = interval_s  # at most 1/interval_s captures a second
        self.idle_interval_s = idle_interval_s  # a metrics-only capture this often when idle
        self.epoch = uuid.uuid4().hex[:12]  # new with each engine: clients then resync
        self.stats = FeedStats()
        self.mirror: KVMirror | None = None  # the feed thread's, once started
        self._capturer = Capturer()  # loop thread only
        self._last_capture = float("-inf")  # loop thread only
        self._last_version = -1  # loop thread only
        self._lock = threading.Lock()
        self._pending: KVExport | None = None  # handed from the loop thread, under _lock
        self._asks: queue.Queue[tuple[str, Any, Callable[[bool, Any], None]]] = queue.Queue()
        self._engine_asks: queue.Queue[tuple[str, Any, Callable[[bool, Any], None]]] = \
            queue.Queue()  # ENGINE_QUESTIONS, for the loop thread
        self._busy = False  # the feed thread is handling a capture (under _lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the engine's loop thread --------------------------------------------------------
    def __call__(self, engine) -> None:
        now = time.monotonic()
        if self._thread is None:
            self._start(engine.describe_config())
        if not self._engine_asks.empty():
            self._answer_from(engine)
        changed = engine.version != self._last_version
        if now - self._last_capture < (self.interval_s if changed else self.idle_interval_s):
            return
        started = time.perf_counter()
        capture = self._capturer.capture(engine)
        self._last_capture, self._last_version = now, capture.version
        with self._lock:
            if self._pending is not None:  # the thread is behind: newest state, every event
                capture = dataclasses.replace(capture,
                                              events=self._pending.events + capture.events)
            self._pending = capture
        self._wake.set()
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started

    def _start(self, config: dict) -> None:
        self.mirror = KVMirror(self.name, self.epoch, config)
        self._thread = threading.Thread(target=self._run, name=f"kv-feed-{self.name}",
                                        daemon=True)
        self._thread.start()

    # --- any thread ------------------------------------------------------------------------
    def ask(self, kind: str, argument: Any, reply: Callable[[bool, Any], None]) -> None:
        """Answer a question from the mirror, on the feed thread: `snapshot` (encoded
        zlib JSON, and the seq it is current at), `snapshot-doc` (the document itself),
        `request` (one request's entry, argument: its id); and `block` (argument:
        {pool, block_id}), answered by the engine itself on its loop thread, between two
        steps (LLMEngine.block_facts). reply(ok, result) is called with the answer."""
        if kind in ENGINE_QUESTIONS:
            self._engine_asks.put((kind, argument, reply))
            return
        self._asks.put((kind, argument, reply))
        self._wake.set()

    def ask_wait(self, kind: str, argument: Any, timeout_s: float) -> Any:
        """ask(), waiting for the answer; LookupError if the feed cannot answer (no
        capture yet), TimeoutError if it does not in time."""
        future: Future = Future()
        self.ask(kind, argument, lambda ok, result: future.set_result((ok, result)))
        ok, result = future.result(timeout_s)
        if not ok:
            raise LookupError(result)
        return result

    @property
    def idle(self) -> bool:
        """Every capture taken so far has been turned into an item."""
        with self._lock:
            return self._pending is None and not self._busy

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _answer_from(self, engine) -> None:
        while True:
            try:
                kind, argument, reply = self._engine_asks.get_nowait()
            except queue.Empty:
                return
            try:
                argument = argument if isinstance(argument, dict) else {}
                reply(True, engine.block_facts(argument.get("pool"), argument.get("block_id")))
            except Exception as e:  # the asker hears why; the loop goes on
                reply(False, f"{type(e).__name__}: {e}")

    # --- the feed thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(ASK_POLL_S)
            self._wake.clear()
            with self._lock:
                capture, self._pending = self._pending, None
                self._busy = capture is not None
            try:
                if capture is not None:
                    self.emit(self._item(capture))
            except Exception:  # a broken consumer must not stop the feed
                log.exception("%s: the KV feed could not hand on an item", self.name)
            finally:
                with self._lock:
                    self._busy = False
            self._answer()

    def _item(self, capture: KVExport) -> dict:
        started, cpu = time.perf_counter(), time.thread_time()
        delta = self.mirror.apply(capture)
        kept, counts = select_events(capture.events)
        records = [event_record(e) for e in kept]
        # the metrics history's point: the figures over time; the KV held by tenant (a
        # table) rides the deltas and snapshots only
        point = {k: v for k, v in capture.metrics.items() if k != "kv_by_tenant"}
        item = {"seq": delta["seq"], "epoch": self.epoch, "records": records,
                "point": {"ts": capture.ts, "step": capture.step, **point},
                "prefix": prefix_changes(capture.events), "delta": None}
        if delta["seq"] > 1:  # the first one has no base: clients start from a snapshot
            delta["events"] = records
            delta["event_counts"] = counts
            item["delta"] = encode(delta)
            self.stats.deltas += 1
            self.stats.delta_bytes += len(item["delta"])
        self.stats.publish_s += time.perf_counter() - started
        self.stats.publish_cpu_s += time.thread_time() - cpu
        return item

    def _answer(self) -> None:
        snapshot = None  # built once for all the snapshot questions waiting
        while True:
            try:
                kind, argument, reply = self._asks.get_nowait()
            except queue.Empty:
                return
            try:
                if self.mirror is None or self.mirror.seq == 0:
                    reply(False, "no capture yet")
                elif kind == "snapshot":
                    if snapshot is None:
                        snapshot = encode(self.mirror.snapshot(), level=1)
                        self.stats.snapshots_sent += 1
                    reply(True, {"seq": self.mirror.seq, "data": snapshot})
                elif kind == "snapshot-doc":
                    reply(True, self.mirror.snapshot())
                elif kind == "request":
                    reply(True, {"seq": self.mirror.seq,
                                 "entry": self.mirror.request_entry(str(argument))})
                else:
                    reply(False, f"unknown question {kind!r}")
            except Exception as e:  # the asker hears why
                log.exception("%s: answering %s failed", self.name, kind)
                reply(False, f"{type(e).__name__}: {e}")
