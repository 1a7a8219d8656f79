"""Prefix-cache events in vLLM's wire format over ZMQ: a subscriber written as a vLLM
KV-aware router would be (its own msgspec structs, from vllm/distributed/kv_events.py)
follows the stores, removals and clears of an engine, and fills a gap by replay."""
from __future__ import annotations

import tempfile

import msgspec
import zmq

from engine.block_hash import hash_blocks, root_hash

from .sim import greedy, sim_engine


# --- the subscriber's side: vLLM's structs, as a router built for vLLM declares them ---
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def received(sub: zmq.Socket) -> dict[int, KVEventBatch]:
    out = {}
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        out[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    return out


def replay(address: str, start: int) -> dict[int, KVEventBatch]:
    # DEALER: one request, a stream of replies (frames: empty delimiter, seq, payload)
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(address)
    req.send_multipart((b"", start.to_bytes(8, "big")))
    out = {}
    try:
        while True:
            assert req.poll(5000), "no replay answer"
            _, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    finally:
        req.close(linger=0)


def test_stores_removals_clears_and_replay():
    short = tempfile.mkdtemp(prefix="kv", dir="/tmp")  # (ipc paths: at most 107 bytes)
    pub, rep = f"ipc://{short}/events", f"ipc://{short}/replay"
    engine = sim_engine(num_gpu_blocks=16, kv_events_endpoint=pub,
                        kv_events_replay_endpoint=rep)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        prompt = list(range(100, 140))  # 10 full blocks of 4
        engine.generate([prompt], greedy(2))
        for i in range(3):  # distinct prompts: the pool of 16 reuses the first one's blocks
            engine.generate([list(range(200 + 100 * i, 240 + 100 * i))], greedy(2))
        engine.reset_prefix_cache()
        live = received(sub)
        # A subscriber that joined late (ZMQ's slow joiner) asks for what it missed.
        batches = {**replay(rep, 0), **live}
        assert sorted(batches) == list(range(len(batches))) and len(batches) >= 4
        events = [e for seq in sorted(batches) for e in batches[seq].events]
    finally:
        sub.close(linger=0)
        engine.close()

    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert isinstance(events[-1], AllBlocksCleared)
    assert all(e.medium == "GPU" and e.block_size == 4 for e in stored)
    # the first prompt's blocks, in chain order, each with its parent and its tokens
    chain = hash_blocks(root_hash(engine.runner.model_id, None), prompt, 4)
    first = [h for e in stored for h in e.block_hashes][:10]
    assert first == chain
    by_hash = {}
    for e in stored:
        assert len(e.token_ids) == 4 * len(e.block_hashes)
        for k, h in enumerate(e.block_hashes):
            parent = e.parent_block_hash if k == 0 else e.block_hashes[k - 1]
            assert parent is None or parent in by_hash, "a block stored before its parent"
            by_hash[h] = e.token_ids[4 * k:4 * k + 4]
    assert by_hash[chain[3]] == prompt[12:16]
    # reusing blocks removed some of the first prompt's hashes, each stored earlier
    assert removed and set(removed) <= set(by_hash) and set(removed) & set(chain)


def test_no_endpoint_no_cost():
    engine = sim_engine()
    engine.generate([list(range(40))], greedy(2))
    assert not engine.events.full  # nobody asks for full hashes and token ids


def test_the_cpu_tier_publishes_its_blocks_with_medium_cpu():
    short = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    pub = f"ipc://{short}/events"
    engine = sim_engine(num_gpu_blocks=16, num_cpu_blocks=12, cpu_prefix_cache=True,
                        kv_events_endpoint=pub)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        engine.generate([[1, 2, 3, 4]], greedy(1))  # (the subscriber joins meanwhile)
        received(sub)
        prompt = list(range(100, 140))  # 10 full blocks of 4
        engine.generate([prompt], greedy(2))
        for i in range(3):  # the pool of 16 reuses the first prompt's blocks: to the CPU
            engine.generate([list(range(200 + 100 * i, 240 + 100 * i))], greedy(2))
        events = [e for batch in received(sub).values() for e in batch.events]
    finally:
        sub.close(linger=0)
        engine.close()
    chain = hash_blocks(root_hash(engine.runner.model_id, None), prompt, 4)
    gpu_stored = {h: e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
                  for h in e.block_hashes}
    cpu_stored = {h: e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
                  for h in e.block_hashes}
    cpu_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"
                   for h in e.block_hashes]
    assert set(chain[:3]) <= set(cpu_stored)  # the first ones reused went to the CPU tier
    for h in chain[:3]:  # each with the parent and tokens it had on the GPU
        k = chain.index(h)
        assert cpu_stored[h].token_ids == prompt[4 * k:4 * k + 4]
        assert cpu_stored[h].parent_block_hash == (chain[k - 1] if k else None)
        assert h in gpu_stored
    # a CPU pool of 12 cannot keep every offloaded block: the oldest leave it, said so
    assert cpu_removed and set(cpu_removed) <= set(cpu_stored)
    assert set(engine.kv.cpu.cached) == set(cpu_stored) - set(cpu_removed)


def test_the_replay_socket_ignores_malformed_and_oversized_requests():
    """A replay request whose start is not 8 bytes is ignored (no answer), one larger than
    the socket reads drops its connection; a well-formed request right after is served."""
    short = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    pub, rep = f"ipc://{short}/events", f"ipc://{short}/replay"
    engine = sim_engine(num_gpu_blocks=16, kv_events_endpoint=pub,
                        kv_events_replay_endpoint=rep)
    bad = zmq.Context.instance().socket(zmq.DEALER)
    bad.connect(rep)
    try:
        engine.generate([list(range(100, 140))], greedy(2))
        bad.send_multipart((b"", b"\x00" * 3))
        bad.send_multipart((b"", b"\x00" * 4096))
        assert replay(rep, 0)  # (served after both bad requests were read)
        assert not bad.poll(200)
    finally:
        bad.close(linger=0)
        engine.close()
