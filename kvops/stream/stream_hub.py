"""The web side of the job stream (kvops/stream/job_stream.py): one reader per web process,
demultiplexing to the listeners of that process.

A listener (an SSE response, a job websocket, a non-streaming /v1 call) opens a
Subscription before its job can produce anything (`open()` fixes the reader's position
first, `bind()` names the job, inside the transaction that creates it), so it misses no
update. The reader never waits for a listener: each has a bounded queue, and one that
falls too far behind (MAX_BACKLOG updates waiting, or nothing read for
KVOPS_STREAM_STALL_S while updates wait: its socket is full because the client stopped
reading) is cut off with an error, and its `on_cut_off` runs (a /v1 stream cancels its
job, so a stuck client does not hold an engine slot until max_tokens). If Redis fails, or an entry is missing (a producer's sequence number skipped),
the listeners that may have lost an update end with an error too; none is left waiting.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeout
from django.conf import settings

from kvops.stream.job_stream import STREAM_KEY, decode_entry

log = logging.getLogger(__name__)

READ_BLOCK_MS = 2000
READ_COUNT = 500  # entries per read
MAX_BACKLOG = 5000  # updates a listener may have waiting before it is cut off
RETRY_S = 0.5


class StreamError(Exception):
    """This listener's updates cannot be delivered any more; the message says why."""


_FAILED = object()  # queued after an error, so a waiting listener wakes up


class Subscription:
    """A job's updates for one listener, in the order the producers wrote them."""

    def __init__(self, hub: JobStreamHub) -> None:
        self.hub = hub
        self.job_id: int | None = None  # set by bind
        self.engine: str | None = None  # engine of the last update (for gap reports)
        self.error: str | None = None
        self.on_cut_off: Callable[[], None] | None = None  # runs if the reader falls behind
        self._queue: asyncio.Queue = asyncio.Queue()
        self._last_read = hub.clock()  # when the listener last asked for updates

    def deliver(self, update: dict, engine: str) -> None:
        """Reader side (the event loop's thread)."""
        if self.error is not None:
            return
        if self._queue.qsize() >= MAX_BACKLOG:
            self.cut_off(f"this client fell more than {MAX_BACKLOG} updates behind its job")
            return
        if not self._queue.empty() and self.hub.clock() - self._last_read > self.hub.stall_s:
            self.cut_off(f"this client read nothing for {self.hub.stall_s:g} s while its "
                         "job went on")
            return
        if engine:
            self.engine = engine
        self._queue.put_nowait(update)

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            self._queue.put_nowait(_FAILED)

    def cut_off(self, message: str) -> None:
        if self.error is not None:
            return
        log.info("job %s: a listener was cut off: %s", self.job_id, message)
        self.fail(message)
        if self.on_cut_off is not None:
            self.on_cut_off()

    async def next_batch(self, timeout_s: float | None) -> list[dict]:
        """Every update waiting now, or the next one (TimeoutError after timeout_s);
        StreamError once the subscription failed."""
        if self.error is not None and self._queue.empty():
            raise StreamError(self.error)
        self._last_read = self.hub.clock()
        try:
            items = [await asyncio.wait_for(self._queue.get(), timeout_s)]
        finally:
            self._last_read = self.hub.clock()
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        if any(item is _FAILED for item in items):
            raise StreamError(self.error or "the job stream failed")
        return items

    def close(self) -> None:
        self.hub.unbind(self)


class JobStreamHub:
    """One per event loop (a web process has one): the reader task and the listeners."""

    def __init__(self, redis_url: str, stall_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = settings.KVOPS_STREAM_STALL_S if stall_s is None else stall_s
        self.clock = clock
        # A read blocks up to READ_BLOCK_MS; the socket waits well past that, so that a
        # busy event loop late to take the answer is not taken for Redis gone.
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5,
                                              socket_timeout=READ_BLOCK_MS / 1000 + 10,
                                              health_check_interval=30)
        self._lock = threading.Lock()  # bind() runs on worker threads (sync_to_async)
        self._subs: dict[int, set[Subscription]] = {}  # job id -> listeners, under _lock
        self.num_listeners = 0  # bound subscriptions, under _lock
        self._last_id: str | None = None  # reader only, once positioned
        self._last_seq: dict[str, int] = {}  # producer -> last sequence number seen
        self._positioned: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.num_gaps = 0  # entries found missing (read by tests)

    async def open(self) -> Subscription:
        """A listener that will see every update written from now on; bind it to a job
        before that job can be dispatched."""
        await self._ensure_reader()
        return Subscription(self)

    async def subscribe(self, job_id: int) -> Subscription:
        sub = await self.open()
        self.bind(sub, job_id)
        return sub

    def bind(self, sub: Subscription, job_id: int) -> None:
        """Name the subscription's job (from any thread)."""
        with self._lock:
            sub.job_id = job_id
            group = self._subs.setdefault(job_id, set())
            if sub not in group:
                group.add(sub)
                self.num_listeners += 1

    def unbind(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.job_id)
            if subs is not None and sub in subs:
                subs.discard(sub)
                self.num_listeners -= 1
                if not subs:
                    del self._subs[sub.job_id]

    # --- the reader ----------------------------------------------------------------------
    async def _ensure_reader(self) -> None:
        if self._task is None or self._task.done():
            self._positioned = asyncio.get_running_loop().create_future()
            self._task = asyncio.get_running_loop().create_task(self._read_forever(),
                                                                name="kvops-job-stream")
        await asyncio.shield(self._positioned)

    async def _position(self) -> None:
        newest = await self._redis.xrevrange(STREAM_KEY, count=1)
        self._last_id = newest[0][0].decode() if newest else "0-0"

    async def _read_forever(self) -> None:
        while True:
            try:
                if self._last_id is None:
                    await self._position()
                if not self._positioned.done():
                    self._positioned.set_result(None)
                reply = await self._redis.xread({STREAM_KEY: self._last_id}, count=READ_COUNT,
                                                block=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except RedisTimeout as e:  # a slow answer, not Redis gone: read on from here
                log.warning("reading the job stream timed out (%s); reading on", e)
                continue
            except Exception as e:  # Redis away: nobody can be sure of their updates
                log.warning("reading the job stream failed: %s", e)
                self._fail_all(f"lost the connection to Redis while streaming: {e}")
                self._last_id = None  # after a restart the stream may be new
                if not self._positioned.done():
                    self._positioned.set_exception(StreamError(f"Redis is not reachable: {e}"))
                    self._positioned = asyncio.get_running_loop().create_future()
                await asyncio.sleep(RETRY_S)
                continue
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode()
                    self._dispatch(decode_entry(fields))

    def _dispatch(self, doc: dict) -> None:
        src, seq, engine = doc["src"], doc["seq"], doc.get("engine", "")
        last = self._last_seq.get(src)
        self._last_seq[src] = seq
        if last is not None and seq != last + 1:
            self.num_gaps += 1
            log.warning("job stream: %d entries of %s (engine %r) are missing",
                        seq - last - 1, src, engine)
            self._fail_engine(engine, f"updates from engine {engine or '?'} were lost "
                                      "(the job stream has a gap)")
        with self._lock:
            subs = self._subs
            for update in doc["u"]:
                for sub in tuple(subs.get(update["job"], ())):
                    sub.deliver(update, engine)

    def _fail_engine(self, engine: str, message: str) -> None:
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            if sub.engine in (None, "", engine):
                sub.fail(message)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.fail(message)


_hubs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, JobStreamHub]" = \
    weakref.WeakKeyDictionary()


def get_hub() -> JobStreamHub:
    """This event loop's hub (created on first use)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = JobStreamHub(settings.REDIS_URL)
    return hub
