"""An engine's recent KV history in Redis, to rebuild its state at any moment of the last
KVOPS_TIMELINE_SECONDS: the engine page's timeline and GET /api/engines/<name>/timeline/.

The history is a row of windows. A window starts with a keyframe (the full snapshot, as
the REST API stores it, taken every KVOPS_TIMELINE_KEYFRAME_S) and holds the deltas the
publisher sent after it, until the next keyframe. The state at time t is the keyframe of
the window holding t with the window's deltas up to t applied (docs/live-protocol.md's
rules: in sequence, a duplicate skipped). Deltas are kept as the websocket carried them
(zlib JSON), so storing one costs no encoding. Whole windows go, oldest first, once the
next one starts before the horizon, and while the history is over KVOPS_TIMELINE_BYTES.

Redis keys, per engine: `...:timeline` (sorted set: window id -> keyframe time), one list
per window (keyframe, then deltas), `...:timeline:bytes` (hash: window id -> bytes) and
`...:timeline:newest` (the time of the newest state stored). `TimelineWriter` is used by
the engine's publisher thread alone; the readers are the API's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.observe.feed import decode, encode
from kvops.live import redis_client

INDEX_KEY = "kvops:engine:{name}:timeline"
WINDOW_KEY = "kvops:engine:{name}:timeline:{window}"
BYTES_KEY = "kvops:engine:{name}:timeline:bytes"
NEWEST_KEY = "kvops:engine:{name}:timeline:newest"
EXPIRE_MARGIN_S = 60  # keys outlive the horizon by this: a dead engine's history fades


@dataclass(slots=True)
class TimelineLimits:
    seconds: float  # how far back the history reaches
    max_bytes: int  # what it may take in Redis, deltas and keyframes together
    keyframe_s: float  # between two keyframes (a window's length)
    # How long past the horizon, in wall time, a window nobody writes to any more outlives
    # its last write (a benchmark laying out a history faster or slower than it happened
    # needs more).
    expire_margin_s: float = EXPIRE_MARGIN_S

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and self.keyframe_s > 0 and self.max_bytes > 0
                and self.expire_margin_s > 0):
            raise ValueError(f"timeline limits must be positive: {self}")

    @property
    def expire_s(self) -> int:
        return int(self.seconds + self.keyframe_s + self.expire_margin_s)


@dataclass(slots=True)
class _Window:
    id: str  # "<epoch>:<keyframe seq>"
    epoch: str
    seq: int  # the keyframe's
    last_seq: int  # of the last delta stored in it (the keyframe's at first)


class TimelineWriter:
    """Stores one engine's keyframes and deltas; the engine's publisher thread only."""

    def __init__(self, name: str, limits: TimelineLimits) -> None:
        self.name = name
        self.limits = limits
        self._recent: list[_Window] = []  # the last two windows, oldest first
        self._next_keyframe = 0.0  # time.monotonic() when one is due
        self._bytes = 0  # stored now, as the last trim counted them and adds since
        self._newest_ts = float("-inf")  # of the newest state stored

    def keyframe_due(self) -> bool:
        return time.monotonic() >= self._next_keyframe

    def add_keyframe(self, snapshot: dict) -> None:
        """Start a window with this snapshot (KVMirror.snapshot()'s document)."""
        epoch, seq, ts = snapshot["epoch"], snapshot["seq"], snapshot["ts"]
        self._next_keyframe = time.monotonic() + self.limits.keyframe_s
        if self._recent and self._recent[-1].epoch == epoch and self._recent[-1].seq == seq:
            return  # nothing happened since the last keyframe: its window goes on
        window = _Window(f"{epoch}:{seq}", epoch, seq, seq)
        blob = encode(snapshot, level=1)
        key = WINDOW_KEY.format(name=self.name, window=window.id)
        pipe = redis_client().pipeline(transaction=True)
        pipe.delete(key)
        pipe.rpush(key, blob)
        pipe.expire(key, self.limits.expire_s)
        pipe.zadd(INDEX_KEY.format(name=self.name), {window.id: ts})
        pipe.hset(BYTES_KEY.format(name=self.name), window.id, len(blob))
        self._newest(pipe, ts)
        pipe.execute()
        self._recent = (self._recent + [window])[-2:]
        self.trim(ts)

    def add_delta(self, epoch: str, seq: int, ts: float, blob: bytes) -> None:
        """A delta as the publisher sent it (encoded). It goes to the newest window it
        follows: one whose keyframe already had it (taken while it waited to be sent)
        goes to the window before. Before the first keyframe there is nowhere to put it."""
        window = next((w for w in reversed(self._recent) if w.epoch == epoch and w.seq < seq), None)
        if window is None:
            return
        if seq != window.last_seq + 1:  # one was lost (Redis was away): start afresh soon
            self._next_keyframe = 0.0
        window.last_seq = seq
        key = WINDOW_KEY.format(name=self.name, window=window.id)
        pipe = redis_client().pipeline(transaction=False)
        pipe.rpush(key, blob)
        pipe.expire(key, self.limits.expire_s)
        pipe.hincrby(BYTES_KEY.format(name=self.name), window.id, len(blob))
        self._newest(pipe, ts)
        pipe.execute()
        self._bytes += len(blob)
        if self._bytes > self.limits.max_bytes:
            self.trim(ts)

    def _newest(self, pipe, ts: float) -> None:
        # (a delta the last keyframe already had is older than it: the newest stays)
        self._newest_ts = max(self._newest_ts, ts)
        pipe.set(NEWEST_KEY.format(name=self.name), repr(self._newest_ts), ex=self.limits.expire_s)
        for key in (INDEX_KEY, BYTES_KEY):
            pipe.expire(key.format(name=self.name), self.limits.expire_s)

    def trim(self, now: float) -> None:
        """Drop the windows wholly older than the horizon, then the oldest ones while the
        history is over its bytes (the newest window always stays)."""
        client = redis_client()
        ids = [(w.decode(), start) for w, start in
               client.zrange(INDEX_KEY.format(name=self.name), 0, -1, withscores=True)]
        sizes = {k.decode(): int(v) for k, v in client.hgetall(BYTES_KEY.format(name=self.name)).items()}
        horizon = now - self.limits.seconds
        drop = [w for (w, _), (_, next_start) in zip(ids, ids[1:]) if next_start <= horizon]
        kept = [w for w, _ in ids if w not in drop]
        total = sum(sizes.get(w, 0) for w in kept)
        while total > self.limits.max_bytes and len(kept) > 1:
            oldest = kept.pop(0)
            drop.append(oldest)
            total -= sizes.get(oldest, 0)
        self._bytes = total
        if not drop:
            return
        self._recent = [w for w in self._recent if w.id not in drop]  # no delta goes there now
        pipe = client.pipeline(transaction=True)
        pipe.delete(*(WINDOW_KEY.format(name=self.name, window=w) for w in drop))
        pipe.zrem(INDEX_KEY.format(name=self.name), *drop)
        pipe.hdel(BYTES_KEY.format(name=self.name), *drop)
        pipe.execute()


def limits_from_settings() -> TimelineLimits:
    from django.conf import settings

    return TimelineLimits(seconds=float(settings.KVOPS_TIMELINE_SECONDS),
                          max_bytes=int(settings.KVOPS_TIMELINE_BYTES),
                          keyframe_s=float(settings.KVOPS_TIMELINE_KEYFRAME_S))


# --- reading (the API) ------------------------------------------------------------------
def windows(name: str) -> tuple[list[dict], float | None]:
    """The stored windows, oldest first ({id, start, bytes}), and the time of the newest
    state stored (None: nothing stored)."""
    client = redis_client()
    pipe = client.pipeline(transaction=True)
    pipe.zrange(INDEX_KEY.format(name=name), 0, -1, withscores=True)
    pipe.hgetall(BYTES_KEY.format(name=name))
    pipe.get(NEWEST_KEY.format(name=name))
    index, sizes, newest = pipe.execute()
    sizes = {k.decode(): int(v) for k, v in sizes.items()}
    out = [{"id": w.decode(), "start": start, "bytes": sizes.get(w.decode(), 0)}
           for w, start in index]
    return out, (float(newest) if newest is not None else None)


def window_at(name: str, at: float, through_window: bool) -> dict | None:
    """The window holding time `at`: {window: {id, start, end (the next one's start, None
    for the newest)}, keyframe, deltas, newest}, with the deltas up to `at` (all of the
    window's when through_window) less their KV events (GET .../events/ has those).
    None when no window holds it (before the oldest kept, or nothing stored)."""
    client = redis_client()
    index = INDEX_KEY.format(name=name)
    before = client.zrevrangebyscore(index, at, "-inf", start=0, num=1, withscores=True)
    if not before:
        return None
    window_id, start = before[0][0].decode(), before[0][1]
    pipe = client.pipeline(transaction=True)
    pipe.lrange(WINDOW_KEY.format(name=name, window=window_id), 0, -1)
    pipe.zrangebyscore(index, f"({start}", "+inf", start=0, num=1, withscores=True)
    pipe.get(NEWEST_KEY.format(name=name))
    blobs, after, newest = pipe.execute()
    if not blobs:  # trimmed between the two reads
        return None
    keyframe = decode(blobs[0])
    if keyframe.get("type") != "snapshot":
        raise ValueError(f"timeline window {window_id} of {name} does not start with a keyframe")
    deltas = []
    for blob in blobs[1:]:
        delta = decode(blob)
        if delta["seq"] <= keyframe["seq"]:
            continue
        if not through_window and delta["ts"] > at:
            break
        delta.pop("events", None)
        delta.pop("event_counts", None)
        deltas.append(delta)
    return {"window": {"id": window_id, "start": start, "end": after[0][1] if after else None},
            "keyframe": keyframe, "deltas": deltas,
            "newest": float(newest) if newest is not None else None}
