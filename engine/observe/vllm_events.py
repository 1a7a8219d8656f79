"""The engine's prefix-cache events over ZMQ in vLLM's wire format, so that KV-aware
routers written for vLLM (llm-d, NVIDIA Dynamo) can follow kvops engines.

Set EngineConfig.kv_events_endpoint (KVOPS_ENGINE_KV_EVENTS_ENDPOINT), e.g.
`tcp://*:5557`: a PUB socket sends each step's events as multipart frames
(topic, 8-byte big-endian sequence number, msgpack KVEventBatch). With
kv_events_replay_endpoint too, a ROUTER socket answers a request carrying a start
sequence number (8 bytes, big-endian) with every buffered batch from it on, each as
(sequence, payload), then (-1, b"") - as vLLM's publisher does. An endpoint with `*`,
`::` or an ipc:// / inproc:// address is bound, any other connected to.

The events, as vLLM's vllm/distributed/kv_events.py declares them, translated from the
engine's one typed event stream (VllmTranslator):
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

from engine.config import EngineConfig
from engine.kv.events import EventLog

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


class VllmTranslator:
    """The engine's typed KV events (engine/kv/events.py) as vLLM's: what a router that
    mirrors a prefix cache needs, group 0's hashes only (a hybrid model's other layer
    groups cache under hashes no router knows). It reads the event stream with the full
    hashes (EventLog.subscribe(full=True)).

    A block stored on the CPU tier arrives by hash alone; vLLM's BlockStored carries its
    parent and tokens, which the translator remembers from the block's BlockStored on
    the GPU (the most recent `memory` hashes: a tier stores what the GPU pool reuses in
    the same step, or what it is about to reuse)."""

    def __init__(self, block_size: int, memory: int) -> None:
        self.block_size = block_size
        self.memory = memory
        self._chains: collections.OrderedDict[bytes, tuple[bytes | None, list[int]]] = \
            collections.OrderedDict()  # hash -> (parent hash, token ids)

    def translate(self, events: list) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for e in events:
            if e.type == "AllBlocksCleared":
                self._chains.clear()
                out.append(AllBlocksCleared())
            elif e.group or e.hashes is None:
                continue
            elif e.type == "BlockStored" and e.pool == "gpu":
                out += self._stored_gpu(e.hashes, e.parents, e.token_ids)
            elif e.type == "BlockStored":
                out += [self._stored_tier(h, e.pool.upper()) for h in e.hashes]
            elif e.type == "BlockEvicted":
                out.append(BlockRemoved(block_hashes=list(e.hashes), medium=e.pool.upper()))
        return out

    def _stored_gpu(self, hashes: list[bytes], parents: list, tokens: list[int]) -> list:
        """One BlockStored per run of blocks each the child of the one before."""
        bs, out, start = self.block_size, [], 0
        for i, h in enumerate(hashes):
            self._remember(h, parents[i], tokens[i * bs:(i + 1) * bs])
            if i + 1 == len(hashes) or parents[i + 1] != h:
                out.append(BlockStored(block_hashes=hashes[start:i + 1],
                                       parent_block_hash=parents[start],
                                       token_ids=tokens[start * bs:(i + 1) * bs],
                                       block_size=bs, lora_id=None, medium=MEDIUM_GPU,
                                       lora_name=None))
                start = i + 1
        return out

    def _stored_tier(self, block_hash: bytes, medium: str) -> BlockStored:
        parent, tokens = self._chains.get(block_hash, (None, []))
        if block_hash in self._chains:
            self._chains.move_to_end(block_hash)
        return BlockStored(block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens,
                           block_size=self.block_size, lora_id=None, medium=medium,
                           lora_name=None)

    def _remember(self, block_hash: bytes, parent: bytes | None, tokens: list[int]) -> None:
        self._chains[block_hash] = (parent, list(tokens))
        self._chains.move_to_end(block_hash)
        while len(self._chains) > self.memory:
            self._chains.popitem(last=False)


REPLAY_REQUEST_BYTES = 256  # the largest frame the replay socket reads


class KVEventsOut:
    """An engine's prefix-cache changes as vLLM publishes them: its event stream with
    the full hashes, translated and handed to `publisher` (anything with publish(events);
    by default the ZMQ publisher of EngineConfig.kv_events_endpoint) after each step and
    each cache command."""

    def __init__(self, config: EngineConfig, events: EventLog, num_blocks: int,
                 publisher=None) -> None:
        """num_blocks: the engine's GPU and CPU blocks (the hashes the translator keeps)."""
        self.publisher = publisher if publisher is not None else ZmqKVEventPublisher(
            config.kv_events_endpoint, config.kv_events_replay_endpoint)
        self._events = events.subscribe(full=True)
        self._translator = VllmTranslator(config.block_size, num_blocks)

    def publish(self) -> None:
        """The changes since the last call, as one KVEventBatch."""
        self.publisher.publish(self._translator.translate(self._events.take()))

    def close(self) -> None:
        close = getattr(self.publisher, "close", None)
        if close is not None:
            close()


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
            # a replay request is [client, empty, 8-byte start]: nothing larger is read
            self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_BYTES)
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
        if len(start) != 8:
            log.warning("kv events: a replay request with a %d-byte start ignored", len(start))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
