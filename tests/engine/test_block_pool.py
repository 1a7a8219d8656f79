import hashlib
import struct

import pytest

from engine.block_hash import hash_block, hash_blocks, root_hash
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv.events import EventLog
from tests.support.clock import Clock


def make_pool(n: int = 8) -> BlockPool:
    return BlockPool(n, enable_caching=True, events=EventLog(1000))


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    assert len(q) == 4
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[2])


def test_freed_uncached_blocks_are_reused_first_and_cached_ones_last():
    pool = make_pool(4)
    a, b, c, d = pool.take_new(4)
    pool.cache(a, b"h" * 32)
    pool.free([a])  # cached -> tail
    pool.free([b])  # uncached -> head
    assert pool.eviction_order(4) == [b.block_id, a.block_id]
    taken = pool.take_new(1)
    assert taken == [b]


def test_lazy_eviction_drops_hash_only_when_slot_is_reused():
    events = EventLog(100)
    pool = BlockPool(2, True, events)
    a, b = pool.take_new(2)
    pool.cache(a, b"x" * 32)
    pool.free([a])
    assert pool.get_cached(b"x" * 32) is a  # still findable at ref 0
    events.take()
    assert pool.take_new(1) == [a]
    assert pool.get_cached(b"x" * 32) is None
    evicted = [e for e in events.take() if e.type == "BlockEvicted"]
    assert evicted and evicted[0].block_ids == [a.block_id]


def test_prefix_hit_revives_a_cached_block_from_the_middle():
    pool = make_pool(4)
    blocks = pool.take_new(4)
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]) * 32)
    pool.free(blocks)
    hit = pool.get_cached(bytes([2]) * 32)
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert [b.block_id for b in pool.free_queue] == [0, 1, 3]


def test_double_free_is_an_invariant_error():
    pool = make_pool(2)
    (a,) = pool.take_new(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a])


def test_taking_more_than_free_is_an_invariant_error():
    pool = make_pool(2)
    with pytest.raises(RuntimeError, match="asked gpu pool for 3"):
        pool.take_new(3)


def test_one_block_per_hash():
    pool = make_pool(2)
    a, b = pool.take_new(2)
    assert pool.cache(a, b"y" * 32)
    assert not pool.cache(b, b"y" * 32)
    assert b.block_hash is None


def test_pinned_block_is_never_in_the_free_queue():
    pool = make_pool(2)
    (a,) = pool.take_new(1)
    pool.cache(a, b"p" * 32)
    assert pool.pin(a)
    assert not pool.pin(a)  # idempotent: one reference per pin
    pool.free([a])
    assert a.ref_cnt == 1 and not pool.free_queue.contains(a)
    pool.evict(None)
    assert pool.get_cached(b"p" * 32) is a
    assert pool.unpin(a)
    assert a.ref_cnt == 0 and pool.free_queue.contains(a)


def test_evict_takes_lru_cached_blocks_and_moves_them_to_the_head():
    pool = make_pool(4)
    blocks = pool.take_new(3)
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]) * 32)
    pool.free(blocks)  # LRU order: 0, 1, 2 after the one never-used block 3
    victims = pool.evict(2)
    assert [v.block_id for v, _ in victims] == [0, 1]
    assert victims[0][1] == bytes([0]) * 32
    assert pool.get_cached(bytes([2]) * 32) is blocks[2]
    assert pool.eviction_order(2) == [1, 0]


def test_block_hash_is_chained_stable_and_salted():
    root = root_hash("model-a")
    assert root == root_hash("model-a")
    assert root != root_hash("model-b")
    assert root != root_hash("model-a", cache_salt="tenant-1")
    tokens = list(range(10))
    hashes = hash_blocks(root, tokens, 4)
    assert len(hashes) == 2  # only full blocks
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # The same block content after a different prefix hashes differently.
    other = hash_blocks(root, [99] * 4 + tokens[4:8], 4)
    assert other[1] != hashes[1]
    # The wire format is fixed (other processes compare hashes): sha256(parent || int64 LE ids).
    expected = hashlib.sha256(b"\0" * 32 + struct.pack("<3q", 1, 2, 3)).digest()
    assert hash_block(b"\0" * 32, [1, 2, 3]) == expected


# --- eviction policies (EngineConfig.eviction_policy) -------------------------------------

def cached_pool(policy: str, n: int = 6) -> tuple[BlockPool, list[KVBlock]]:
    """n blocks, each cached under a hash of its own and freed in order 0..n-1 (0 the
    least recently freed)."""
    pool = BlockPool(n, enable_caching=True, events=EventLog(1000), eviction_policy=policy)
    blocks = pool.take_new(n)
    for b in blocks:
        pool.cache(b, bytes([b.block_id]) * 32)
    pool.free(blocks)
    return pool, blocks


def test_lru_takes_the_least_recently_freed_first():
    pool, blocks = cached_pool("lru")
    pool.touch([blocks[0]])  # a hit: taken again, then freed again (the most recent)
    pool.free([blocks[0]])
    assert pool.eviction_order(6) == [1, 2, 3, 4, 5, 0]


def test_slru_keeps_what_was_hit_over_what_was_not():
    """Block 0 hit once, then 4 more freed after it: LRU would take it before them, SLRU
    takes the blocks never hit first."""
    pool, blocks = cached_pool("slru")
    pool.touch([blocks[0]])
    pool.free([blocks[0]])
    pool.touch([blocks[1]])
    pool.free([blocks[1]])
    assert pool.eviction_order(6) == [2, 3, 4, 5, 0, 1]
    taken = pool.take_new(4)
    assert [b.block_id for b in taken] == [2, 3, 4, 5]
    assert pool.get_cached(bytes([0]) * 32) is blocks[0]  # still cached


def test_lfu_keeps_the_most_hit():
    pool, blocks = cached_pool("lfu")
    for b, hits in zip(blocks, [3, 0, 1, 0, 2, 1]):
        for _ in range(hits):
            pool.touch([b])
            pool.free([b])
    # by hits (0, 0, 1, 1, 2, 3), least recently freed first within a count
    assert pool.eviction_order(6) == [1, 3, 2, 5, 4, 0]


def test_priority_keeps_the_prefixes_of_important_requests():
    """Scheduling priority: a lower value is more important. Blocks taken by a request of
    priority -2 outlive blocks of priority 0, which outlive those of priority 5; a hit by
    an important request raises a block's importance."""
    pool = BlockPool(6, enable_caching=True, events=EventLog(1000), eviction_policy="priority")
    low = pool.take_new(2, keep=5)
    high = pool.take_new(2, keep=-2)
    normal = pool.take_new(2, keep=0)
    for b in pool.blocks:
        pool.cache(b, bytes([b.block_id]) * 32)
    pool.free([*high, *normal, *low])
    assert pool.eviction_order(6) == [b.block_id for b in (*low, *normal, *high)]
    pool.touch([low[0]], keep=-5)  # the most important request used it
    pool.free([low[0]])
    assert pool.eviction_order(6)[-1] == low[0].block_id


def test_the_policy_changes_live_keeping_every_free_block():
    pool, blocks = cached_pool("lru")
    pool.touch([blocks[3]])
    pool.free([blocks[3]])
    pool.set_eviction_policy("slru")
    assert sorted(pool.eviction_order(6)) == list(range(6)) and pool.num_free == 6
    assert pool.eviction_order(6)[-1] == 3  # the one hit is kept longest
    pool.set_eviction_policy("lru")
    assert len(pool.free_queue) == 6 and sorted(pool.eviction_order(6)) == list(range(6))
    with pytest.raises(ValueError, match="eviction policy"):
        pool.set_eviction_policy("random")


def test_soft_pins_keep_blocks_over_the_others_until_their_time_is_up():
    """Under LRU: soft-pinned blocks are taken after every other free block (the more
    important first kept longer), a hit renews the pin, a lapsed pin ranks as before, and
    a soft pin never keeps a block from a request."""
    clock = Clock()
    pool = BlockPool(6, enable_caching=True, events=EventLog(1000), clock=clock)
    blocks = pool.take_new(6)
    for b in blocks:
        pool.cache(b, bytes([b.block_id]) * 32)
    pool.free(blocks)
    assert pool.soft_pin([blocks[0]], priority=0, ttl_s=60) == [blocks[0]]
    assert pool.soft_pin([blocks[1]], priority=-1, ttl_s=10) == [blocks[1]]
    assert pool.eviction_order(6) == [2, 3, 4, 5, 0, 1]
    assert pool.num_soft_pinned == 2
    clock.now += 9
    pool.touch([blocks[1]])  # a hit: renewed for 10 s from now
    pool.free([blocks[1]])
    clock.now += 5
    pool.expire_soft_pins()
    assert pool.eviction_order(6)[-2:] == [0, 1]  # both still soft-pinned
    clock.now += 6  # block 1's lapsed (renewed at +9, for 10 s); block 0's holds
    assert pool.expire_soft_pins() == 1
    assert pool.eviction_order(6) == [2, 3, 4, 5, 1, 0]
    taken = pool.take_new(6)  # a soft pin takes no block from a request
    assert len(taken) == 6 and not pool.soft_pinned and pool.num_soft_pinned == 0
    pool.free(taken)


def test_a_soft_unpin_puts_a_block_back_in_its_place():
    clock = Clock()
    pool = BlockPool(4, enable_caching=True, events=EventLog(1000), eviction_policy="slru",
                     clock=clock)
    blocks = pool.take_new(4)
    for b in blocks:
        pool.cache(b, bytes([b.block_id]) * 32)
    pool.free(blocks)
    pool.soft_pin([blocks[0]], priority=0, ttl_s=60)
    assert pool.eviction_order(4) == [1, 2, 3, 0]
    assert pool.soft_unpin([blocks[0], blocks[1]]) == [blocks[0]]
    assert pool.eviction_order(4)[-1] == 0  # (re-ranked: the most recently placed)
    assert pool.num_soft_pinned == 0
