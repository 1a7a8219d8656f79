"""Channels fan-out and live state in Redis: the one module that sends to groups.

Groups: `engine.<name>` (KV snapshots and deltas), `job.<id>` (a job's tokens).
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

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "kvops:engine:{name}:snapshot"
EVENTS_KEY = "kvops:engine:{name}:events"
SNAPSHOT_TTL_S = 3600


def job_group(job_id: int | str) -> str:
    return f"job.{job_id}"


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
    """A daemon thread running an event loop that performs group_send calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.layer = get_channel_layer()
        thread = threading.Thread(target=self.loop.run_forever, name="kvops-fanout", daemon=True)
        thread.start()

    def send(self, group: str, message: dict) -> None:
        asyncio.run_coroutine_threadsafe(self._send(group, message), self.loop)

    async def _send(self, group: str, message: dict) -> None:
        try:
            await self.layer.group_send(group, message)
        except Exception as e:  # Redis down: the next message or a resync catches up
            log.warning("group_send to %s failed: %s", group, e)


_fanout_lock = threading.Lock()
_fanout: _Fanout | None = None


def group_send(group: str, message: dict) -> None:
    """Fire-and-forget group_send from any thread of a worker."""
    global _fanout
    with _fanout_lock:
        if _fanout is None:
            _fanout = _Fanout()
    _fanout.send(group, message)


def store_snapshot(name: str, snapshot: dict) -> None:
    redis_client().set(SNAPSHOT_KEY.format(name=name), json.dumps(snapshot), ex=SNAPSHOT_TTL_S)


def load_snapshot(name: str) -> dict | None:
    raw = redis_client().get(SNAPSHOT_KEY.format(name=name))
    return None if raw is None else json.loads(raw)


def publish_job_update(job_id: int, payload: dict[str, Any]) -> None:
    group_send(job_group(job_id), {"type": "job.update", "job_id": job_id, **payload})
