"""The engine's prefix-cache events over ZMQ in vLLM's wire format, so that KV-aware
routers written for vLLM (llm-d, NVIDIA Dynamo) can follow kvops engines.

Set EngineConfig.kv_events_endpoint (KVOPS_ENGINE_KV_EVENTS_ENDPOINT), e.g.
`tcp://*:5557`: a PUB socket sends each step's events as multipart frames
(topic, 8-byte big-endian sequence number, msgpack KVEventBatch). With
kv_events_replay_endpoint too, a ROUTER socket answers a request carrying a start
sequence number (8 bytes, big-endian) with every buffered batch from it on, each as
(sequence, payload), then (-1, b"") - as vLLM's publisher does. An endpoint with `*`,
`::` or an ipc:// / inproc:// address is bound, any other connected to.

The events, as vLLM's vllm/distributed/kv_events.py declares them:
* BlockStored: blocks newly findable by hash (hashes in chain order, the hash of the
  block before them, their token ids, the block size, medium "GPU", or "CPU" for the
  CPU tier of the prefix cache: EngineConfig.cpu_prefix_cache);
* BlockRemoved: hashes no longer findable (their block was reused, evicted by an
  operator, or its data was never written because the step failed);
* AllBlocksCleared: the prefix cache was reset.
kvops' block hashes are 32-byte sha256 chains (engine/block_hash.py), sent as bytes.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_vllm(raw: list[tuple], block_size: int) -> list[KVCacheEvent]:
    """The engine's raw records (EventLog.external) as vLLM events."""
    out: list[KVCacheEvent] = []
    for record in raw:
        kind = record[0]
        if kind == "stored":  # (the medium is last when it is not the GPU)
            hashes, parent, token_ids = record[1:4]
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                   token_ids=token_ids, block_size=block_size, lora_id=None,
                                   medium=record[4] if len(record) > 4 else MEDIUM_GPU,
                                   lora_name=None))
        elif kind == "removed":
            out.append(BlockRemoved(block_hashes=record[1],
                                    medium=record[2] if len(record) > 2 else MEDIUM_GPU))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
    return out


class ZmqKVEventPublisher:
    """PUB (and optionally ROUTER for replay) on a thread of its own: publish() only
    queues, so the step loop never waits on a socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, hwm: int = 100_000) -> None:
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=100_000)
        self._buffer: collections.deque = collections.deque(maxlen=buffer_batches)
        self._seq = itertools.count()
        self._running = True
        self.dropped = 0  # batches not queued because the thread fell far behind
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            self.dropped += 1  # (a subscriber sees the gap in the sequence and replays)

    def close(self, timeout_s: float = 2.0) -> None:
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError as e:
                    log.warning("kv events: replay request failed: %s", e)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
