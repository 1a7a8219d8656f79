"""The contract of a prefix-cache tier (PrefixTier, engine/kv/tiers/base.py), one test run
against each tier: CPUTier and DiskTier, each below a GPU pool, driven as the KV
coordinator drives them. Block bytes live in a dict standing in for the runner; the
copies a tier returns are run on it, so that a tier that keeps or gives back the wrong
bytes fails."""
from __future__ import annotations

import pytest

from engine.block_hash import short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import EventLog
from engine.kv.tiers.base import PrefixTier
from engine.kv.tiers.cpu import NO_CPU_TIER_METRICS, CPUTier
from engine.kv.tiers.disk import DiskStore, DiskTier
from engine.kv.tiers.disk_seal import file_bytes

BLOCK = 4  # tokens a block
BYTES = 48  # a block's bytes
CAPACITY = 3  # blocks a tier holds
GPU_BLOCKS = 8


def h(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int) -> bytes:
    return bytes([(i * 37 + 11) % 251]) * BYTES


class Chain:
    """A GPU pool and one tier below it, its hook set as the coordinator sets it, and the
    block bytes of every pool (the runner's)."""

    def __init__(self, kind: str, folder) -> None:
        self.events = EventLog(10_000)
        self.gpu = BlockPool(GPU_BLOCKS, True, self.events, "gpu")
        self.uncomputed: set[int] = set()
        self.data: dict[tuple[str, int], bytes] = {}
        self.store = None
        if kind == "cpu":
            cpu = BlockPool(CAPACITY, True, self.events, "cpu")
            self.tier: PrefixTier = CPUTier(cpu, self.gpu, self.events, self.uncomputed)
        else:
            self.store = DiskStore(folder, CAPACITY * file_bytes(BYTES), {"model": "m"})
            self.tier = DiskTier(self.store, self.gpu, self.events,
                                 lambda i: self.data["gpu", i],
                                 lambda i, b: self.data.__setitem__(("gpu", i), b),
                                 min_hits=1, unwritten=self.uncomputed)
        self.gpu.on_evict = self.tier.offer

    def run(self, copies: list[tuple[int, int]], src: str, dst: str) -> None:
        for a, b in copies:
            self.data[dst, b] = self.data[src, a]

    def store_blocks(self, ids: list[int]) -> None:
        """Cache these blocks on the GPU, have prompts ask for them twice (a tier that
        admits by reuse takes them), then reuse every GPU block: the tier is offered
        them and keeps them (its copies run, its writes finish)."""
        for i in ids:
            block = self.gpu.take_new(1)[0]
            self.data["gpu", block.block_id] = payload(i)
            assert self.gpu.cache(block, h(i))
            self.gpu.free([block])
        hashes = [h(i) for i in ids]
        self.tier.count_prompt(hashes)
        self.tier.count_prompt(hashes)
        taken = self.gpu.take_new(self.gpu.num_free)  # (offered before their bytes change)
        self.run(self.tier.flush(), "gpu", self.tier.pool)
        for block in taken:  # (their bytes are another's now)
            self.data["gpu", block.block_id] = b"\0" * BYTES
        self.gpu.free(taken)
        self.tier.mark_computed()
        self.settle()

    def bring_back(self, i: int) -> tuple[list[KVBlock], list[KVBlock]]:
        """Block i back on the GPU, as the coordinator asks for it: (GPU blocks that hold
        it cached, the tier's blocks loaded into new GPU blocks), and the new GPU block's
        bytes checked."""
        found = self.tier.lookup([h(i)])
        read = self.tier.promote([], [h(i)])
        gpu_run = [self.gpu.get_cached(h(i))] if read else []
        if found:
            new = self.gpu.take_new(len(found))
            self.run(self.tier.load(found, new), self.tier.pool, "gpu")
            assert self.data["gpu", new[0].block_id] == payload(i)
            self.gpu.free(new)
        if gpu_run:
            assert self.data["gpu", gpu_run[0].block_id] == payload(i)
        return gpu_run, found

    def settle(self) -> None:
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


@pytest.fixture(params=["cpu", "disk"])
def chain(request, tmp_path):
    made = Chain(request.param, tmp_path)
    yield made
    made.close()


def test_a_tier_stores_finds_gives_back_counts_and_evicts_a_block(chain):
    tier = chain.tier
    assert tier.above is chain.gpu and tier.num_cached == 0 and not tier.holds(h(1))
    chain.store_blocks([1])
    stored = [e for e in chain.events.take() if e.type == "BlockStored" and e.pool == tier.pool]
    assert [e.block_hashes for e in stored] == [[short(h(1))]]
    # found by its hash
    assert tier.holds(h(1)) and not tier.holds(h(2)) and tier.num_cached == 1
    # given back one way, not both: copied into new GPU blocks, or read back into the pool
    gpu_run, loaded = chain.bring_back(1)
    assert len(gpu_run) + len(loaded) == 1
    # counted as the tier's own hit, the way the coordinator counts it
    if gpu_run:
        assert tier.count_read_back(gpu_run, BLOCK, BLOCK) == 1
    if loaded:
        tier.record_hit("r1", loaded, BLOCK)
    assert tier.hit_tokens == BLOCK
    assert tier.metrics(BYTES)[f"{tier.pool}_prefix_cache_hits"] == BLOCK
    assert tier.count_read_back(gpu_run, BLOCK, BLOCK) == 0  # (counted once)
    chain.run(tier.flush(), "gpu", tier.pool)  # (releases what the load read)
    assert tier.held() == []
    # least recently used first: CAPACITY newer blocks push it out
    chain.store_blocks([2, 3, 4])
    tier.count_prompt([])  # (a tier that says its evictions late says them here)
    assert not tier.holds(h(1)) and all(tier.holds(h(i)) for i in (2, 3, 4))
    assert tier.num_cached == CAPACITY
    evicted = [x for e in chain.events.take() if e.type == "BlockEvicted" and e.pool == tier.pool
               for x in e.block_hashes]
    assert short(h(1)) in evicted
    # a reset: nothing it held is found again
    assert tier.reset() == CAPACITY
    assert tier.num_cached == 0 and not any(tier.holds(h(i)) for i in (2, 3, 4))
    assert chain.bring_back(2) == ([], [])


def test_a_tier_keeps_no_block_whose_data_the_coming_step_writes(chain):
    """A GPU block registered for the coming step holds no K/V yet: reused before the
    step runs, it is not kept."""
    block = chain.gpu.take_new(1)[0]
    assert chain.gpu.cache(block, h(5))
    chain.gpu.free([block])
    chain.uncomputed.add(block.block_id)
    chain.tier.count_prompt([h(5)])
    chain.tier.count_prompt([h(5)])
    taken = chain.gpu.take_new(chain.gpu.num_free)
    assert chain.tier.flush() == []
    chain.gpu.free(taken)
    chain.settle()
    assert not chain.tier.holds(h(5)) and chain.tier.num_cached == 0


def test_the_cpu_tiers_metrics_are_those_an_engine_without_one_shows():
    events = EventLog(10)
    tier = CPUTier(BlockPool(2, True, events, "cpu"), BlockPool(2, True, events, "gpu"),
                   events, set())
    assert list(tier.metrics(BYTES)) == list(NO_CPU_TIER_METRICS)
