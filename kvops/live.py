"""Channels fan-out and live state in Redis: the one module that sends to groups.

Groups: `engine.<name>` (KV snapshots and deltas), `engine-summary.<name>` (metrics
only). Jobs' updates do not go through groups: they travel on the job stream
(kvops/stream/job_stream.py), which `publish_job_state` writes to. Redis also holds each
engine's bounded history of KV events and metrics (streams) and the queries waiting for
its publisher.
Worker threads call the sync functions here; they hand messages to one background
event loop per process, so a slow Redis never blocks the engine's step loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import redis
from channels.layers import get_channel_layer
from django.conf import settings

from kvops.stream.job_stream import StreamProducer, state_update

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "kvops:engine:{name}:snapshot"
EVENTS_KEY = "kvops:engine:{name}:events"
SNAPSHOT_TTL_S = 3600


def engine_group(name: str) -> str:
    return f"engine.{name}"


_redis_lock = threading.Lock()
_redis: redis.Redis | None = None


def redis_client() -> redis.Redis:
    """A process-wide Redis client (thread-safe connection pool)."""
    global _redis
    with _redis_lock:
        if _redis is None:
            _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5,
                                          socket_connect_timeout=5, health_check_interval=30)
        return _redis


class _Fanout:
    """A daemon thread running an event loop that performs the channel layer's sends
    (group_send_wait, channel_send_wait)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.layer = get_channel_layer()
        thread = threading.Thread(target=self.loop.run_forever, name="kvops-fanout", daemon=True)
        thread.start()


_fanout_lock = threading.Lock()
_fanout: _Fanout | None = None


def store_snapshot(name: str, snapshot: dict) -> None:
    redis_client().set(SNAPSHOT_KEY.format(name=name), json.dumps(snapshot), ex=SNAPSHOT_TTL_S)


def load_snapshot(name: str) -> dict | None:
    raw = redis_client().get(SNAPSHOT_KEY.format(name=name))
    return None if raw is None else json.loads(raw)


_producer_lock = threading.Lock()
_producer: StreamProducer | None = None


def publish_job_state(job_id: int, attempt: int, payload: dict[str, Any]) -> None:
    """A job's status changed: tell its listeners on the job stream. Raises the Redis
    error if it could not (listeners then see a gap and end with an error)."""
    publish_job_states([(job_id, attempt, payload)])


def publish_job_states(states: list[tuple[int, int, dict[str, Any]]]) -> None:
    """Several jobs' new states in one stream entry (job_id, attempt, payload each)."""
    global _producer
    with _producer_lock:
        if _producer is None:
            _producer = StreamProducer(redis_client())
        _producer.send([state_update(job_id, attempt, payload)
                        for job_id, attempt, payload in states])


# --- engine live data (the engine-side publisher and the websocket consumers) -------------
QUERIES_KEY = "kvops:engine:{name}:queries"
METRICS_KEY = "kvops:engine:{name}:metrics"
QUERY_TTL_S = 30  # a query nobody picked up is dropped with its key
SEND_TIMEOUT_S = 5.0


def engine_summary_group(name: str) -> str:
    """Metrics only, a few times a second: what the overview page listens to."""
    return f"engine-summary.{name}"


def _fanout_loop() -> _Fanout:
    global _fanout
    with _fanout_lock:
        if _fanout is None:
            _fanout = _Fanout()
        return _fanout


def _wait(fanout: _Fanout, coroutine, timeout_s: float) -> None:
    """Run coroutine on the fan-out loop and wait for it. One that times out is
    cancelled, so it cannot land later, after messages sent since."""
    future = asyncio.run_coroutine_threadsafe(coroutine, fanout.loop)
    try:
        future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise


def group_send_wait(group: str, message: dict, timeout_s: float = SEND_TIMEOUT_S) -> None:
    """group_send from a worker thread, returning once it is done: messages sent one
    after the other this way arrive in that order (deltas carry sequence numbers)."""
    fanout = _fanout_loop()
    _wait(fanout, fanout.layer.group_send(group, message), timeout_s)


def channel_send_wait(channel: str, message: dict, timeout_s: float = SEND_TIMEOUT_S) -> None:
    """Send to one consumer's channel (an answer to its query), in order with the above."""
    fanout = _fanout_loop()
    _wait(fanout, fanout.layer.send(channel, message), timeout_s)


def append_events(name: str, events: list[dict], maxlen: int) -> None:
    """Add KV events to the engine's bounded history (a Redis stream, trimmed to about
    maxlen entries)."""
    if not events:
        return
    pipe = redis_client().pipeline(transaction=False)
    key = EVENTS_KEY.format(name=name)
    for event in events:
        pipe.xadd(key, {"e": json.dumps(event, separators=(",", ":"))},
                  maxlen=maxlen, approximate=True)
    pipe.execute()


def recent_events(name: str, count: int) -> list[dict]:
    """The last `count` KV events of the engine, oldest first."""
    rows = redis_client().xrevrange(EVENTS_KEY.format(name=name), count=count)
    return [json.loads(fields[b"e"]) for _, fields in reversed(rows)]


def events_page(name: str, after: str | None, limit: int) -> tuple[list[dict], str | None]:
    """Stored KV events of the engine, oldest first: those after the stream id `after`
    (exclusive; None: from the oldest kept), at most `limit`. Each event carries its
    stream id as `id` ("<ms>-<n>", in order); returns them and the oldest id kept."""
    client = redis_client()
    key = EVENTS_KEY.format(name=name)
    rows = client.xrange(key, min=f"({after}" if after else "-", max="+", count=limit)
    oldest = client.xrange(key, min="-", max="+", count=1)
    events = [{"id": row_id.decode(), **json.loads(fields[b"e"])} for row_id, fields in rows]
    return events, (oldest[0][0].decode() if oldest else None)


def append_metrics(name: str, point: dict, maxlen: int) -> None:
    """One point of the engine's metrics history (a Redis stream of about maxlen points)."""
    redis_client().xadd(METRICS_KEY.format(name=name),
                        {"m": json.dumps(point, separators=(",", ":"))},
                        maxlen=maxlen, approximate=True)


def recent_metrics(name: str, count: int) -> list[dict]:
    """The last `count` metrics points of the engine, oldest first."""
    rows = redis_client().xrevrange(METRICS_KEY.format(name=name), count=count)
    return [json.loads(fields[b"m"]) for _, fields in reversed(rows)]


def post_engine_query(name: str, query: dict) -> None:
    """Ask the engine's publisher something (a full snapshot, one request's block
    table); it answers on query["reply_to"], a consumer's channel."""
    key = QUERIES_KEY.format(name=name)
    pipe = redis_client().pipeline(transaction=True)
    pipe.rpush(key, json.dumps(query))
    pipe.expire(key, QUERY_TTL_S)
    pipe.execute()


def take_engine_queries(name: str, limit: int = 100) -> list[dict]:
    """The queries waiting for the engine's publisher, oldest first (removed)."""
    raw = redis_client().lpop(QUERIES_KEY.format(name=name), limit) or []
    return [json.loads(item) for item in raw]
