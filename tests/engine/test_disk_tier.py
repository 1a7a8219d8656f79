"""The disk tier's store (engine/disk_tier.py): blocks as files that survive a restart,
a checksum and the engine's identity on each (a bad or foreign file is a miss, deleted
and counted), LRU within a byte budget, writes behind that close() finishes."""
from __future__ import annotations

import os

import pytest

from engine.disk_tier import DiskStore

IDENTITY = {"model": "m", "kv_format": "float32", "block_size": 4, "block_bytes": 64}


def h(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int) -> bytes:
    return bytes([i % 251]) * 64


@pytest.fixture
def store(tmp_path):
    made = []

    def make(capacity: int = 1 << 20, identity: dict = IDENTITY) -> DiskStore:
        made.append(DiskStore(tmp_path, capacity, identity))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_blocks_come_back_and_outlive_a_restart(store, tmp_path):
    first = store()
    for i in range(5):
        assert first.put(h(i), payload(i))
    assert not first.put(h(0), payload(0))  # (there already)
    assert first.get(h(3)) == payload(3)  # (readable while queued, or written)
    first.close()  # finishes the writes
    assert first.stats.stored_blocks == 5
    again = store()
    assert again.num_blocks == 5 and again.contains(h(4))
    assert [again.get(h(i)) for i in range(5)] == [payload(i) for i in range(5)]
    assert again.get(h(9)) is None
    assert again.stats.hit_blocks == 5


def test_a_corrupt_block_is_a_miss_deleted_and_counted(store):
    s = store()
    s.put(h(1), payload(1))
    s.flush()
    path = s._path(h(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    assert s.get(h(1)) is None
    assert s.stats.checksum_failures == 1 and not path.exists() and not s.contains(h(1))


def test_a_block_of_another_model_is_never_read(store, tmp_path):
    ours = store()
    ours.put(h(1), payload(1))
    ours.flush()
    theirs = store(identity={**IDENTITY, "model": "other"})
    assert theirs.root != ours.root and not theirs.contains(h(1))
    # a file of ours placed where theirs would be: its header names our identity
    target = theirs._path(h(1))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(ours._path(h(1)).read_bytes())
    rescanned = store(identity={**IDENTITY, "model": "other"})
    assert rescanned.contains(h(1)) and rescanned.get(h(1)) is None
    assert rescanned.stats.checksum_failures == 1 and not target.exists()


def test_the_least_recently_used_blocks_go_for_room(store):
    size = 8 + 2 + 16 + 2 + 8 + 4 + 32 + 64  # header, hash, payload
    s = store(capacity=3 * size)
    for i in range(3):
        s.put(h(i), payload(i))
    s.flush()
    assert s.get(h(0)) == payload(0)  # used again: 1 is now the oldest
    s.put(h(3), payload(3))
    s.flush()
    assert s.contains(h(0)) and not s.contains(h(1)) and s.contains(h(3))
    assert s.num_bytes <= 3 * size and s.stats.evicted_blocks == 1
    assert not s._path(h(1)).exists()


def test_a_write_cut_short_leaves_no_block(store, tmp_path):
    s = store()
    s.put(h(1), payload(1))
    s.close()
    torn = s._path(h(2)).with_suffix(".tmp")
    torn.parent.mkdir(parents=True, exist_ok=True)
    torn.write_bytes(b"half a block")
    again = store()
    assert not again.contains(h(2)) and not torn.exists() and again.contains(h(1))
    assert oct(os.stat(again.root).st_mode & 0o777) == "0o700"
