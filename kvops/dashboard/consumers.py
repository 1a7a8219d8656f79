"""Websocket consumers: /ws/engines/<name>/ (an engine's KV state, live) and
/ws/jobs/<id>/ (a job's tokens and block table).

Thin: they decide who may listen, check what clients say, and forward what the engine's
publisher (kvops/worker/publisher.py) sends through the channel layer; a job's own updates come
from the job stream (kvops/jobs/job_listener.py). Deltas and snapshots
arrive encoded (zlib JSON) and leave as binary frames untouched; everything else is a
JSON text frame. docs/live-protocol.md describes the messages.

Redis may restart under them. The channel layer keeps group memberships in Redis, so a
restart forgets them: a consumer re-adds its groups every REJOIN_S, and as soon as its
channel-layer receive works again after failing; meanwhile the websocket stays open. A
client that missed deltas sees a gap in sequence numbers and resyncs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.layers import get_channel_layer
from channels.utils import await_many_dispatch
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine.observe.feed import encode
from kvops import live, selectors
from kvops.dashboard import visibility
from kvops.jobs.job_listener import JobFailed, JobListener, reload
from kvops.models import Engine
from kvops.stream.stream_hub import StreamError, get_hub

log = logging.getLogger(__name__)

CLOSE_NOT_LOGGED_IN = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_FLOODING = 4429
MAX_MESSAGE_CHARS = 1024
SNAPSHOT_WAIT_S = 3.0  # then serve the stored snapshot, marked stale
MIN_QUERY_INTERVAL_S = 0.25  # snapshot / block-table queries per connection
MESSAGES_PER_S = 10.0  # client messages a connection may send, on average,
MESSAGE_BURST = 30  # and at once
FLOOD_CLOSE_AFTER = 100  # messages refused in a row: the connection is closed (4429)
JOB_SENDS_PER_S = 10.0  # job page updates, at most
REJOIN_S = 5.0  # group memberships are re-added this often (a Redis restart loses them)
RETRY_MIN_S, RETRY_MAX_S = 0.25, 2.0  # pauses between tries while Redis is away
REDIS_DOWN = (RedisError, OSError)  # what the channel layer and kvops.live raise then


def _quiet_layer_cleanups(loop: asyncio.AbstractEventLoop) -> None:
    """channels-redis cleans up after a receive in a task of its own, which nobody
    awaits: when Redis goes away meanwhile, asyncio prints that task's ConnectionError
    with a traceback once the task is collected. That is the outage the consumers
    already report in one line (channel layer unreachable): say it in one line too.
    Anything else goes to the loop's handler as before. Installed once per loop."""
    if getattr(loop, "_kvops_quiet_layer", False):
        return
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), REDIS_DOWN):
            log.warning("channel layer: %s (%s)", context.get("message"), context["exception"])
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    loop._kvops_quiet_layer = True
SHOWN_CHARS = 40  # of a client's value quoted back in an error

# Client messages: type -> {field: allowed values (a tuple of strings or a range of ints)}.
ENGINE_MESSAGES = {
    "subscribe": {"level": ("full", "summary")},
    "resync": {},
    "history": {"what": ("events", "metrics"), "count": range(1, 1001)},
    "ping": {},
    "block": {"pool": ("gpu", "cpu"), "id": range(1 << 24)},
}
JOB_MESSAGES = {"blocks": {}, "ping": {}}
EXAMPLE = "a message is a JSON object such as {\"type\": \"ping\"}"


class ClientError(Exception):
    """A client message that is not one of ours; said back to the client."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def parse_message(text: str | None, schema: dict) -> dict:
    """A client message, checked against the schema, or ClientError saying what is wrong."""
    if text is None:
        raise ClientError("send JSON text frames, not binary ones")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ClientError(f"a message has at most {MAX_MESSAGE_CHARS} characters")
    try:
        content = json.loads(text)
    except ValueError:
        raise ClientError(f"not JSON: {EXAMPLE}") from None
    except RecursionError:  # e.g. "[[[[…": the decoder recurses once per level
        raise ClientError(f"JSON nested too deeply: {EXAMPLE}") from None
    if not isinstance(content, dict):
        raise ClientError(EXAMPLE)
    kind = content.get("type")
    if not isinstance(kind, str) or kind not in schema:
        said = "no `type`" if kind is None else f"unknown message type {_shown(kind)}"
        raise ClientError(f"{said}; one of {', '.join(schema)}")
    fields = schema[kind]
    unknown = sorted(set(content) - {"type"} - set(fields))
    if unknown:
        raise ClientError(f"{kind}: unknown field(s) {', '.join(map(_shown, unknown))}")
    for name, allowed in fields.items():
        if name not in content:
            raise ClientError(f"{kind}: `{name}` is required")
        value = content[name]
        ok = (isinstance(value, str) and value in allowed) if isinstance(allowed, tuple) else (
            isinstance(value, int) and not isinstance(value, bool) and value in allowed)
        if not ok:
            shown = ", ".join(allowed) if isinstance(allowed, tuple) else \
                f"an integer in [{allowed.start}, {allowed.stop - 1}]"
            raise ClientError(f"{kind}: `{name}` must be {shown}, not {_shown(value)}")
    return content


class MessageBudget:
    """A token bucket: `rate` messages a second on average, `burst` at once."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@database_sync_to_async
def _engine(name: str) -> tuple[Engine, bool] | None:
    engine = Engine.objects.filter(name=name).first()
    return None if engine is None else (engine, selectors.engine_alive(engine))


@database_sync_to_async
def _visible_job(user, job_id: int):
    return selectors.jobs_visible_to(user).filter(pk=job_id).first()


@database_sync_to_async
def _block_size(engine_name: str) -> int | None:
    engine = Engine.objects.filter(name=engine_name).first()
    return None if engine is None else engine.config.get("block_size")


def _raise_if_cancelled() -> None:
    """A cancellation that lands while redis-py cleans up after a failed read can come
    out as a Redis error: code that handles those by waiting or retrying must still stop
    when its task is being cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


def _redis_down_message(error: Exception) -> str:
    return (f"live data is unavailable for now (Redis: {error}); it comes back by itself "
            "once Redis is reachable")


class _Consumer(AsyncJsonWebsocketConsumer):
    """Common ground: a logged-in user, checked messages, groups kept joined through a
    Redis restart and left on disconnect."""
    schema: dict = {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # All of these belong to this consumer's event loop task.
        self.joined: set[str] = set()  # groups it should be in (re-added by rejoin())
        self.tasks: set[asyncio.Task] = set()  # background work, cancelled on disconnect
        self.budget = MessageBudget(MESSAGES_PER_S, MESSAGE_BURST)
        self.refused = 0  # client messages refused in a row for going over the budget
        self.retry_s = RETRY_MIN_S  # the next pause while the channel layer fails
        self.last_query = float("-inf")  # monotonic time of the last engine query

    async def __call__(self, scope, receive, send) -> None:
        """AsyncConsumer.__call__, with a channel-layer receive that outlives read
        timeouts and Redis restarts: the stock one raises, which ends the consumer and
        drops the websocket."""
        self.scope = scope
        _quiet_layer_cleanups(asyncio.get_running_loop())
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.channel_name = await self.channel_layer.new_channel()
        self.base_send = send
        try:
            await await_many_dispatch([receive, self._channel_receive], self.dispatch)
        except StopConsumer:
            pass

    async def _channel_receive(self) -> dict:
        """The next message from the channel layer, or `layer.retry` when none came: a
        read timed out (redis-py gives up after 5 s, as long as channels-redis' blocking
        pop waits), or Redis is away (then after a pause, longer each time, and an
        attempt to re-join the groups a restarted Redis lost). One attempt per call, so
        a consumer that ends never waits for more than one."""
        try:
            message = await self.channel_layer.receive(self.channel_name)
        except RedisTimeoutError:
            return {"type": "layer.retry"}
        except REDIS_DOWN as e:
            _raise_if_cancelled()
            if self.retry_s == RETRY_MIN_S:
                log.warning("%s: channel layer unreachable (%s); retrying",
                            self.scope["path"], e)
            await asyncio.sleep(self.retry_s)
            self.retry_s = min(2 * self.retry_s, RETRY_MAX_S)
            await self.rejoin()
            return {"type": "layer.retry"}
        self.retry_s = RETRY_MIN_S
        return message

    async def layer_retry(self, message: dict) -> None:
        """Nothing came from the channel layer: the next receive starts."""

    def start(self, coroutine) -> asyncio.Task:
        """Run coroutine in the background until it ends or the client disconnects."""
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def refuse_anonymous(self) -> bool:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_NOT_LOGGED_IN)
            return True
        return False

    async def join_only(self, group: str) -> None:
        """Be in this group and no other (raises REDIS_DOWN; rejoin() finishes the job)."""
        old, self.joined = self.joined - {group}, {group}
        for other in old:
            await self.channel_layer.group_discard(other, self.channel_name)
        await self.channel_layer.group_add(group, self.channel_name)

    async def rejoin(self) -> bool:
        """Add this consumer to its groups again (idempotent); False if Redis is away."""
        try:
            for group in list(self.joined):
                await self.channel_layer.group_add(group, self.channel_name)
        except REDIS_DOWN as e:  # said once, by _channel_receive
            _raise_if_cancelled()
            log.debug("%s: re-joining groups failed: %s", self.scope["path"], e)
            return False
        return True

    async def _keep_joined(self) -> None:
        while True:
            await asyncio.sleep(REJOIN_S)
            await self.rejoin()

    async def accept_live(self) -> None:
        """Accept the websocket, and keep its groups joined while it is open."""
        await self.accept()
        self.start(self._keep_joined())

    async def disconnect(self, code: int) -> None:
        for task in list(self.tasks):
            task.cancel()
        groups, self.joined = self.joined, set()
        try:
            for group in groups:
                await self.channel_layer.group_discard(group, self.channel_name)
        except REDIS_DOWN as e:  # the memberships went with Redis, or expire
            log.info("%s: leaving groups failed: %s", self.scope["path"], e)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if not self.budget.take():
            self.refused += 1
            if self.refused >= FLOOD_CLOSE_AFTER:
                if self.refused == FLOOD_CLOSE_AFTER:  # what still comes is dropped
                    log.warning("%s: closed, the client floods it", self.scope["path"])
                    await self.close(code=CLOSE_FLOODING)
                return
            await self.send_json({"type": "error", "message": (
                f"too many messages: at most {MESSAGES_PER_S:g} a second; this one was "
                "dropped")})
            return
        self.refused = 0
        try:
            message = parse_message(text_data, self.schema)
            await getattr(self, f"on_{message['type']}")(message)
        except ClientError as e:
            await self.send_json({"type": "error", "message": str(e)})
        except REDIS_DOWN as e:
            _raise_if_cancelled()
            log.warning("%s: %s", self.scope["path"], e)
            await self.send_json({"type": "error", "message": _redis_down_message(e)})

    async def on_ping(self, message: dict) -> None:
        await self.send_json({"type": "pong", "ts": time.time()})

    def query_delay(self) -> float:
        """Seconds until the next engine query may go: they are MIN_QUERY_INTERVAL_S apart."""
        return max(0.0, self.last_query + MIN_QUERY_INTERVAL_S - time.monotonic())

    async def post_query(self, engine_name: str, query: dict) -> None:
        self.last_query = time.monotonic()
        await sync_to_async(live.post_engine_query, thread_sensitive=False)(engine_name, query)


def _stored_snapshot_frame(name: str) -> bytes | None:
    """The engine's last stored snapshot, marked stale, encoded as live snapshots travel
    (zlib JSON in a binary frame): at 65,536 blocks its JSON alone is over the 1 MiB a
    websocket message may carry."""
    stored = live.load_snapshot(name)
    return None if stored is None else encode({**stored, "type": "snapshot", "stale": True}, level=1)


class EngineConsumer(_Consumer):
    """`subscribe` full (deltas; a snapshot follows) or summary (metrics); `resync` asks
    for a full snapshot again (after a gap in sequence numbers); `history` sends the
    recent KV events or metrics kept in Redis; `block` asks the engine what the snapshot
    does not say of one block (a hovered one)."""
    schema = ENGINE_MESSAGES

    async def connect(self) -> None:
        self.level: str | None = None
        self._snapshot: asyncio.Task | None = None  # a snapshot on its way to the client
        self._block: asyncio.Task | None = None  # a block question waiting for its turn
        self._block_wanted: tuple[str, int] | None = None  # the block asked for last
        if await self.refuse_anonymous():
            return
        # a plain user's frames carry no hashes (kvops/dashboard/visibility.py)
        self.sealed = not visibility.sees_everything(self.scope["user"])
        self.tenant = visibility.viewer_tenant(self.scope["user"])  # (its label in them)
        self.name = self.scope["url_route"]["kwargs"]["name"]
        found = await _engine(self.name)
        if found is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        engine, alive = found
        await self.accept_live()
        await self.send_json({
            "type": "hello", "engine": self.name, "status": engine.status, "alive": alive,
            "config": visibility.config_for(engine.config, self.scope["user"]),
            "metrics": visibility.metrics_for(engine.metrics, self.scope["user"]),
            "operator": self.scope["user"].is_staff})

    async def on_subscribe(self, message: dict) -> None:
        self.level = message["level"]
        if self.level == "summary":
            self._cancel_snapshot()
            await self.join_only(live.engine_summary_group(self.name))
        else:
            await self.join_only(live.engine_group(self.name))
            self._ask_snapshot()
        await self.send_json({"type": "subscribed", "level": self.level})

    async def on_resync(self, message: dict) -> None:
        if self.level != "full":
            raise ClientError("resync: subscribe to level `full` first")
        # The client heard nothing for a while: maybe Redis restarted and took the group
        # memberships with it. A snapshot is only worth sending once the deltas that
        # follow it will come too; until then the client asks again (or reconnects).
        if not await self.rejoin():
            raise ClientError("resync: the channel layer (Redis) is unreachable; "
                              "try again shortly")
        self._ask_snapshot()

    async def on_history(self, message: dict) -> None:
        read = live.recent_events if message["what"] == "events" else live.recent_metrics
        items = await sync_to_async(read, thread_sensitive=False)(self.name, message["count"])
        if self.sealed and message["what"] == "events":
            items = visibility.seal_events(items)
        await self.send_json({"type": "history", "what": message["what"], "items": items})

    async def on_block(self, message: dict) -> None:
        """Ask about the block hovered last: a question waiting for its turn (queries are
        MIN_QUERY_INTERVAL_S apart) asks about the latest block when it goes."""
        self._block_wanted = (message["pool"], message["id"])
        if self._block is None or self._block.done():
            self._block = self.start(self._ask_block())

    async def _ask_block(self) -> None:
        await asyncio.sleep(self.query_delay())
        pool, block_id = self._block_wanted
        try:
            await self.post_query(self.name, {"kind": "block", "reply_to": self.channel_name,
                                              "pool": pool, "block_id": block_id})
        except REDIS_DOWN as e:
            _raise_if_cancelled()
            await self.send_json({"type": "error", "message": _redis_down_message(e)})

    def _ask_snapshot(self) -> None:
        """One snapshot on its way at a time: asking again meanwhile changes nothing."""
        if self._snapshot is None or self._snapshot.done():
            self._snapshot = self.start(self._fetch_snapshot())

    def _cancel_snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot.cancel()
            self._snapshot = None

    async def _fetch_snapshot(self) -> None:
        """Ask the engine's publisher (it answers with engine.snapshot, which cancels this
        task); without an answer in SNAPSHOT_WAIT_S (the engine stopped, or is busy
        starting) its last stored snapshot, marked stale, is better than an empty page."""
        await asyncio.sleep(self.query_delay())
        try:
            await self.post_query(self.name, {"kind": "snapshot", "reply_to": self.channel_name})
            await asyncio.sleep(SNAPSHOT_WAIT_S)
            stored = await sync_to_async(_stored_snapshot_frame, thread_sensitive=False)(self.name)
        except REDIS_DOWN as e:
            _raise_if_cancelled()
            log.warning("%s: snapshot: %s", self.scope["path"], e)
            await self.send_json({"type": "error", "message": _redis_down_message(e)})
            return
        if stored is None:
            await self.send_json({"type": "error", "message": f"engine {self.name} is not "
                                  "publishing and has no stored snapshot"})
            return
        await self.send_frame(stored)

    async def send_frame(self, data: bytes) -> None:
        """A delta or snapshot as this viewer may see it (sealed once per process)."""
        if self.sealed:
            data = await sync_to_async(visibility.frames.seal, thread_sensitive=False)(
                data, self.tenant)
        await self.send(bytes_data=data)

    # --- from the channel layer ---------------------------------------------------------
    async def engine_delta(self, event: dict) -> None:
        if self.level == "full":
            await self.send_frame(event["data"])

    async def engine_snapshot(self, event: dict) -> None:
        self._cancel_snapshot()
        if self.level == "full":
            await self.send_frame(event["data"])

    async def engine_block(self, event: dict) -> None:
        await self.send_json({
            "type": "block", "pool": event["pool"], "id": event["block_id"],
            "facts": visibility.block_facts_for(event["facts"], self.scope["user"]),
            "error": event["error"]})

    async def engine_summary(self, event: dict) -> None:
        if self.level == "summary":
            await self.send_json({"type": "summary", "engine": event["engine"],
                                  "epoch": event["epoch"], "metrics": event["metrics"]})


class NotFoundConsumer(AsyncJsonWebsocketConsumer):
    """A websocket path no consumer serves: closed at once (the handshake is refused)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)


class JobConsumer(_Consumer):
    """The job's state on connect and on every update (cumulative text); `blocks` asks
    its engine for the request's block table (while it runs)."""
    schema = JOB_MESSAGES

    async def connect(self) -> None:
        if await self.refuse_anonymous():
            return
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        job = await _visible_job(self.scope["user"], job_id)
        if job is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.job_id = job.pk
        self.engine_name, self.request_id = job.engine, job.request_id
        await self.accept_live()
        self.start(self._follow())

    async def _follow(self) -> None:
        """Send the job's state now, and again as it changes (at most JOB_SENDS_PER_S
        times a second, with all the text produced meanwhile), until it ends. If its
        updates are lost (Redis away), say so and follow it again from the database."""
        while True:
            try:
                sub = await get_hub().subscribe(self.job_id)  # before the row is read
            except (*REDIS_DOWN, StreamError) as e:
                _raise_if_cancelled()
                await self.send_json({"type": "error", "message": _redis_down_message(e)})
                await asyncio.sleep(RETRY_MAX_S)
                continue
            try:
                listener = JobListener(sub, await reload(self.job_id))
                await self._send_job(listener)
                async for _ in listener.updates():
                    await self._send_job(listener)
                    await asyncio.sleep(1 / JOB_SENDS_PER_S)
                return
            except JobFailed as e:
                await self.send_json({"type": "error", "message": str(e)})
                await asyncio.sleep(RETRY_MIN_S)
            finally:
                sub.close()

    async def _send_job(self, listener: JobListener) -> None:
        state = {**listener.state, "text": listener.text.text,
                 "num_output_tokens": listener.num_output_tokens}
        self.engine_name = state.get("engine") or self.engine_name
        self.request_id = state.get("request_id") or self.request_id
        await self.send_json({"type": "job", "job_id": self.job_id, **state})

    async def on_blocks(self, message: dict) -> None:
        if not (self.engine_name and self.request_id):
            await self.send_json({"type": "blocks", "request": None})
            return
        if self.query_delay() > 0:
            raise ClientError("blocks: too many; at most one every "
                              f"{MIN_QUERY_INTERVAL_S:g} s")
        await self.post_query(self.engine_name, {"kind": "request", "reply_to": self.channel_name,
                                                 "request_id": self.request_id})

    # --- from the channel layer ---------------------------------------------------------
    async def engine_request(self, event: dict) -> None:
        if not hasattr(self, "block_size"):
            self.block_size = await _block_size(event["engine"])
        await self.send_json({
            "type": "blocks", "engine": event["engine"], "request_id": event["request_id"],
            "block_size": self.block_size, "request": event["request"]})
