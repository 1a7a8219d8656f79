"""The prefix cache's second level, in the CPU pool (PrefixTier: engine/kv/tiers/base.py).

CPUTier keeps copies of the GPU pool's cached blocks in the CPU pool, shared with
swapped-out requests (whose swap-outs take CPU blocks like any other, evicting cached
ones), and gives them back by copies into a request's new GPU blocks:

* the GPU pool offers it, through BlockPool.on_evict, the cached blocks a schedule is
  reusing (`offer`); at the end of the schedule `flush` gives each a CPU block and
  returns the copies GPU -> CPU, which run before anything writes those GPU blocks;
* `copy_ahead` writes back, ahead of need, cached GPU blocks next in line for reuse, so
  that their copy runs beside a forward pass instead of in the step that reuses them;
* at admission `lookup` finds the run of the prompt's next hashes it holds, and `load`
  takes them into the request's new GPU blocks (the copies CPU -> GPU).
"""
from __future__ import annotations

from engine.block_hash import BlockHash, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import EventLog
from engine.kv.tiers.base import PrefixTier, emit_stored

# What /metrics says of the CPU tier on an engine without one: its keys are always there
# (CPUTier.metrics gives them their values)
NO_CPU_TIER_METRICS = {"cpu_prefix_cache_hits": 0, "num_cpu_cached_blocks": 0,
                       "cpu_cache_copy_out_bytes": 0, "cpu_cache_copy_in_bytes": 0}


class CPUTier(PrefixTier):
    """The prefix cache's second level in the CPU pool."""
    medium = "CPU"
    where = "on the CPU tier"

    def __init__(self, cpu: BlockPool, gpu: BlockPool, events: EventLog,
                 uncomputed: set[int]) -> None:
        super().__init__(gpu)
        self.cpu = cpu  # shared with swapped-out requests
        self._events = events
        self._gpu_uncomputed = uncomputed  # GPU blocks the coming step writes (no copy yet)
        # GPU blocks reused this schedule: (block id, hash, tenant)
        self._to_store: list[tuple[int, BlockHash, str | None]] = []
        self._held: list[KVBlock] = []  # CPU blocks this step's copies read
        self.uncomputed: list[KVBlock] = []  # CPU blocks this step's copies fill
        self.num_blocks_stored = 0  # copies GPU -> CPU
        self.num_blocks_loaded = 0  # copies CPU -> GPU

    @property
    def num_cached(self) -> int:
        return len(self.cpu.cached)

    def holds(self, block_hash: BlockHash) -> bool:
        return self.cpu.get_cached(block_hash) is not None

    def lookup(self, hashes: list[BlockHash]) -> list[KVBlock]:
        out = []
        if not self.cpu.cached:
            return out
        for block_hash in hashes:
            block = self.cpu.get_cached(block_hash)
            if block is None:
                break
            out.append(block)
        return out

    def load(self, blocks: list[KVBlock], gpu_blocks: list[KVBlock]) -> list[tuple[int, int]]:
        self.cpu.touch(blocks)
        self._held.extend(blocks)
        self.num_blocks_loaded += len(blocks)
        return [(c.block_id, g.block_id) for c, g in zip(blocks, gpu_blocks)]

    def promote(self, run: list[KVBlock], hashes: list[BlockHash]) -> int:
        return 0  # (its blocks are copied into the request's GPU blocks: load)

    def cached_by_tenant(self) -> dict[str, int]:
        return self.cpu.cached_by_tenant()

    def offer(self, evicted: list[tuple[int, BlockHash, str | None]]) -> None:
        uncomputed = self._gpu_uncomputed  # (their data is not written: nothing to keep)
        self._to_store.extend(e for e in evicted if e[0] not in uncomputed)

    def flush(self) -> list[tuple[int, int]]:
        mapping: list[tuple[int, int]] = []
        if self._to_store:
            stored: list[KVBlock] = []
            cpu = self.cpu
            for gpu_id, block_hash, tenant in self._to_store:
                held = cpu.get_cached(block_hash)
                if held is not None:  # the tier has it already: it was used again
                    cpu.refresh(held)
                    continue
                if not cpu.num_free:  # every CPU block holds a swapped request
                    continue
                block = self._block_for(block_hash, tenant)
                stored.append(block)
                mapping.append((gpu_id, block.block_id))
            self._to_store.clear()
            self._stored(stored, "copied from GPU blocks about to be reused")
        if self._held:
            self.cpu.free(self._held)
            self._held = []
        return mapping

    def copy_ahead(self, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """Write-back ahead of need: the runner may copy these while this step's forward
        pass runs, as they are free (neither read nor written by it). When the pool
        reuses them later, flush finds their hash on the tier and copies nothing: the
        copy is off that step's critical path. Call after flush, for a step that runs."""
        mapping: list[tuple[int, int]] = []
        stored: list[KVBlock] = []
        cpu, uncomputed, seen = self.cpu, self._gpu_uncomputed, 0
        for block in self.above.free_queue:
            if seen == horizon or len(stored) == max_blocks:
                break
            seen += 1
            block_hash = block.block_hash
            if block_hash is None or block.block_id in uncomputed \
                    or cpu.get_cached(block_hash) is not None:
                continue
            if not cpu.num_free:
                break
            target = self._block_for(block_hash, block.tenant)
            stored.append(target)
            mapping.append((block.block_id, target.block_id))
        self._stored(stored, "copied ahead from GPU blocks next in line for reuse")
        return mapping

    def _block_for(self, block_hash: BlockHash, tenant: str | None) -> KVBlock:
        """A CPU block registered under the hash (and its tenant), free and the tier's
        most recently used (the caller checked that one is free)."""
        block = self.cpu.take_new(1)[0]
        self.cpu.cache(block, block_hash, tenant)
        self.cpu.free([block])
        return block

    def _stored(self, stored: list[KVBlock], how: str) -> None:
        """Account for CPU blocks the coming copies fill (counted, said, and forgotten
        again if the step fails)."""
        if not stored:
            return
        self.num_blocks_stored += len(stored)
        self.uncomputed.extend(stored)
        emit_stored(self._events, "cpu", stored, f"CPU tier: {how}")

    def mark_computed(self) -> None:
        self.uncomputed.clear()

    def forget_uncomputed(self) -> int:
        dropped = self.cpu.forget_unwritten(self.uncomputed)
        self.uncomputed.clear()
        return len(dropped)

    def record_hit(self, request_id: str, blocks: list[KVBlock], block_size: int,
                   from_below: int = 0) -> None:
        num_tokens = len(blocks) * block_size
        self.hit_tokens += (len(blocks) - from_below) * block_size
        self._events.emit("PrefixHit", request_id=request_id, pool="cpu",
                          block_ids=[b.block_id for b in blocks],
                          block_hashes=[short(b.block_hash) for b in blocks],
                          ref_cnts=[b.ref_cnt for b in blocks], num_tokens=num_tokens,
                          detail="CPU tier: copied into GPU blocks, not recomputed")

    def read_back_among(self, blocks: list[KVBlock]) -> int:
        return 0  # (it reads nothing back into the GPU pool)

    def count_read_back(self, blocks: list[KVBlock], block_size: int, num_tokens: int) -> int:
        return 0

    def held(self) -> list[KVBlock]:
        """CPU blocks this step's loads read (each holds a reference until flush, so that
        no copy of the same step overwrites them)."""
        return self._held

    def reset(self) -> int:
        return self.cpu.forget_all_hashes()

    def metrics(self, block_bytes: int) -> dict:
        """Its own hits (blocks the disk read back into it are the disk's:
        disk_prefix_cache_hits), what it holds, and the bytes copied each way."""
        return {"cpu_prefix_cache_hits": self.hit_tokens,
                "num_cpu_cached_blocks": len(self.cpu.cached),
                "cpu_cache_copy_out_bytes": self.num_blocks_stored * block_bytes,
                "cpu_cache_copy_in_bytes": self.num_blocks_loaded * block_bytes}
