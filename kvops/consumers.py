"""Websocket consumers: /ws/engines/<name>/ (an engine's KV state, live) and
/ws/jobs/<id>/ (a job's tokens and block table).

Thin: they decide who may listen, check what clients say, and forward what the engine's
publisher (kvops/publisher.py) sends through the channel layer. Deltas and snapshots
arrive encoded (zlib JSON) and leave as binary frames untouched; everything else is a
JSON text frame. docs/live-protocol.md describes the messages.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from kvops import live, selectors, services
from kvops.models import Engine

log = logging.getLogger(__name__)

CLOSE_NOT_LOGGED_IN = 4401
CLOSE_NOT_FOUND = 4404
MAX_MESSAGE_CHARS = 1024
SNAPSHOT_WAIT_S = 3.0  # then serve the stored snapshot, marked stale
MIN_QUERY_INTERVAL_S = 0.25  # snapshot / block-table queries per connection

# Client messages: type -> {field: allowed values (a tuple of strings or a range of ints)}.
ENGINE_MESSAGES = {
    "subscribe": {"level": ("full", "summary")},
    "resync": {},
    "history": {"what": ("events", "metrics"), "count": range(1, 1001)},
    "ping": {},
}
JOB_MESSAGES = {"blocks": {}, "ping": {}}


class ClientError(Exception):
    """A client message that is not one of ours; said back to the client."""


def parse_message(text: str | None, schema: dict) -> dict:
    """A client message, checked against the schema, or ClientError saying what is wrong."""
    if text is None:
        raise ClientError("send JSON text frames, not binary ones")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ClientError(f"a message has at most {MAX_MESSAGE_CHARS} characters")
    try:
        content = json.loads(text)
    except ValueError:
        raise ClientError("a message is a JSON object, e.g. {\"type\": \"ping\"}") from None
    if not isinstance(content, dict):
        raise ClientError("a message is a JSON object, e.g. {\"type\": \"ping\"}")
    kind = content.get("type")
    if kind not in schema:
        raise ClientError(f"unknown message type {kind!r}; one of {', '.join(schema)}")
    fields = schema[kind]
    unknown = sorted(set(content) - {"type"} - set(fields))
    if unknown:
        raise ClientError(f"{kind}: unknown field(s) {', '.join(unknown)}")
    for name, allowed in fields.items():
        if name not in content:
            raise ClientError(f"{kind}: `{name}` is required")
        value = content[name]
        ok = (isinstance(value, str) and value in allowed) if isinstance(allowed, tuple) else (
            isinstance(value, int) and not isinstance(value, bool) and value in allowed)
        if not ok:
            shown = ", ".join(allowed) if isinstance(allowed, tuple) else \
                f"an integer in [{allowed.start}, {allowed.stop - 1}]"
            raise ClientError(f"{kind}: `{name}` must be {shown}")
    return content


@database_sync_to_async
def _engine(name: str) -> tuple[Engine, bool] | None:
    engine = Engine.objects.filter(name=name).first()
    return None if engine is None else (engine, selectors.engine_alive(engine))


@database_sync_to_async
def _visible_job(user, job_id: int):
    return selectors.jobs_visible_to(user).filter(pk=job_id).first()


@database_sync_to_async
def _job_state(job) -> dict:
    return services.job_payload(job)


@database_sync_to_async
def _block_size(engine_name: str) -> int | None:
    engine = Engine.objects.filter(name=engine_name).first()
    return None if engine is None else engine.config.get("block_size")


class _Consumer(AsyncJsonWebsocketConsumer):
    """Common ground: a logged-in user, checked messages, groups left on disconnect."""
    schema: dict = {}

    async def refuse_anonymous(self) -> bool:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_NOT_LOGGED_IN)
            return True
        return False

    async def join(self, group: str) -> None:
        await self.channel_layer.group_add(group, self.channel_name)
        self.joined.add(group)

    async def leave_all(self) -> None:
        for group in list(getattr(self, "joined", ())):
            await self.channel_layer.group_discard(group, self.channel_name)
        self.joined = set()

    async def disconnect(self, code: int) -> None:
        await self.leave_all()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = parse_message(text_data, self.schema)
        except ClientError as e:
            await self.send_json({"type": "error", "message": str(e)})
            return
        await getattr(self, f"on_{message['type']}")(message)

    async def on_ping(self, message: dict) -> None:
        await self.send_json({"type": "pong", "ts": time.time()})

    def query_allowed(self) -> bool:
        now = time.monotonic()
        if now - getattr(self, "_last_query", float("-inf")) < MIN_QUERY_INTERVAL_S:
            return False
        self._last_query = now
        return True


class EngineConsumer(_Consumer):
    """`subscribe` full (deltas; a snapshot follows) or summary (metrics); `resync` asks
    for a full snapshot again (after a gap in sequence numbers); `history` sends the
    recent KV events or metrics kept in Redis."""
    schema = ENGINE_MESSAGES

    async def connect(self) -> None:
        self.joined: set[str] = set()
        self.level: str | None = None
        self._fallback: asyncio.Task | None = None
        if await self.refuse_anonymous():
            return
        self.name = self.scope["url_route"]["kwargs"]["name"]
        found = await _engine(self.name)
        if found is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        engine, alive = found
        await self.accept()
        await self.send_json({
            "type": "hello", "engine": self.name, "status": engine.status, "alive": alive,
            "config": engine.config, "metrics": engine.metrics,
            "operator": self.scope["user"].is_staff})

    async def disconnect(self, code: int) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
        await super().disconnect(code)

    async def on_subscribe(self, message: dict) -> None:
        await self.leave_all()
        self.level = message["level"]
        if self.level == "summary":
            await self.join(live.engine_summary_group(self.name))
        else:
            await self.join(live.engine_group(self.name))
            await self._ask_snapshot()
        await self.send_json({"type": "subscribed", "level": self.level})

    async def on_resync(self, message: dict) -> None:
        if self.level != "full":
            await self.send_json({"type": "error", "message": "resync: subscribe to level "
                                                              "`full` first"})
            return
        if self._fallback is not None and not self._fallback.done():
            return  # one is on its way
        if not self.query_allowed():
            await self.send_json({"type": "error", "message": "resync: too many; wait a moment"})
            return
        await self._ask_snapshot()

    async def on_history(self, message: dict) -> None:
        read = live.recent_events if message["what"] == "events" else live.recent_metrics
        items = await sync_to_async(read, thread_sensitive=False)(self.name, message["count"])
        await self.send_json({"type": "history", "what": message["what"], "items": items})

    async def _ask_snapshot(self) -> None:
        query = {"kind": "snapshot", "reply_to": self.channel_name}
        await sync_to_async(live.post_engine_query, thread_sensitive=False)(self.name, query)
        if self._fallback is not None:
            self._fallback.cancel()
        self._fallback = asyncio.ensure_future(self._stale_snapshot_later())

    async def _stale_snapshot_later(self) -> None:
        """The engine did not answer (stopped, or busy starting): its last stored
        snapshot, marked stale, is better than an empty page."""
        await asyncio.sleep(SNAPSHOT_WAIT_S)
        stored = await sync_to_async(live.load_snapshot, thread_sensitive=False)(self.name)
        if stored is None:
            await self.send_json({"type": "error", "message": f"engine {self.name} is not "
                                  "publishing and has no stored snapshot"})
            return
        await self.send_json({**stored, "type": "snapshot", "stale": True})

    # --- from the channel layer ---------------------------------------------------------
    async def engine_delta(self, event: dict) -> None:
        if self.level == "full":
            await self.send(bytes_data=event["data"])

    async def engine_snapshot(self, event: dict) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
            self._fallback = None
        if self.level == "full":
            await self.send(bytes_data=event["data"])

    async def engine_summary(self, event: dict) -> None:
        if self.level == "summary":
            await self.send_json({"type": "summary", "engine": event["engine"],
                                  "epoch": event["epoch"], "metrics": event["metrics"]})


class JobConsumer(_Consumer):
    """The job's state on connect and on every update (cumulative text); `blocks` asks
    its engine for the request's block table (while it runs)."""
    schema = JOB_MESSAGES

    async def connect(self) -> None:
        self.joined = set()
        if await self.refuse_anonymous():
            return
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        job = await _visible_job(self.scope["user"], job_id)
        if job is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.job_id = job.pk
        self.engine_name, self.request_id = job.engine, job.request_id
        await self.join(live.job_group(job.pk))
        await self.accept()
        await self.send_json({"type": "job", "job_id": job.pk, **await _job_state(job)})

    async def on_blocks(self, message: dict) -> None:
        if not (self.engine_name and self.request_id):
            await self.send_json({"type": "blocks", "request": None})
            return
        if not self.query_allowed():
            await self.send_json({"type": "error", "message": "blocks: too many; wait a moment"})
            return
        query = {"kind": "request", "reply_to": self.channel_name,
                 "request_id": self.request_id}
        await sync_to_async(live.post_engine_query, thread_sensitive=False)(
            self.engine_name, query)

    # --- from the channel layer ---------------------------------------------------------
    async def job_update(self, event: dict) -> None:
        self.engine_name = event.get("engine") or self.engine_name
        self.request_id = event.get("request_id") or self.request_id
        await self.send_json({**event, "type": "job"})

    async def engine_request(self, event: dict) -> None:
        if not hasattr(self, "block_size"):
            self.block_size = await _block_size(event["engine"])
        await self.send_json({
            "type": "blocks", "engine": event["engine"], "request_id": event["request_id"],
            "block_size": self.block_size, "request": event["request"]})
