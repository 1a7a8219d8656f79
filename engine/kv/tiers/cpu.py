"""Tiers of the prefix cache below the GPU pool, behind one interface.

A tier keeps copies of cached GPU blocks the pool is about to reuse, findable by hash,
and gives them back when a prompt's prefix continues past what the GPU holds: copied
into new GPU blocks instead of recomputed (vLLM's KV offloading, SGLang's HiCache). The
coordinator (engine/kv/coordinator.py) drives it:

* the GPU pool tells it, through BlockPool.on_evict, which cached blocks a schedule is
  reusing (`note_reused`); at the end of the schedule `flush` gives each a tier block
  and returns the copies GPU -> tier, which run before anything writes those GPU blocks;
* `copy_ahead` writes back, ahead of need, cached GPU blocks next in line for reuse, so
  that their copy runs beside a forward pass instead of in the step that reuses them;
* at admission `lookup` finds the run of the prompt's next hashes it holds, and `load`
  takes them into the request's new GPU blocks (the copies tier -> GPU).

CPUTier keeps its blocks in the CPU pool, shared with swapped-out requests (whose
swap-outs take CPU blocks like any other, evicting cached ones). A disk tier implements
the same interface.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from engine.block_hash import BlockHash, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import EventLog


class PrefixTier(ABC):
    """A level of the prefix cache below the GPU, as the coordinator uses it."""
    medium: str  # "CPU", "DISK": as events and the vLLM-format publisher name it

    def __init__(self) -> None:
        # prompt tokens found here, not recomputed: this tier's own (a block a tier below
        # read back into it is that tier's hit, counted there)
        self.hit_tokens = 0
        self.num_blocks_stored = 0  # copies GPU -> tier
        self.num_blocks_loaded = 0  # copies tier -> GPU

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Blocks it can hold."""

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Blocks it holds now, findable by hash."""

    @abstractmethod
    def lookup(self, hashes: list[BlockHash]) -> list:
        """Its blocks for the leading run of these hashes that it holds (the run stops at
        the first it lacks)."""

    @abstractmethod
    def load(self, blocks: list, gpu_blocks: list[KVBlock]) -> list[tuple[int, int]]:
        """lookup's blocks into these new GPU blocks: the (tier, gpu) copies, which the
        step runs before its forward pass. The tier blocks stay until flush."""

    @abstractmethod
    def note_reused(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """The GPU pool is reusing these cached (block id, hash): keep a copy of each."""

    @abstractmethod
    def flush(self) -> list[tuple[int, int]]:
        """End of a schedule: the (gpu, tier) copies of what note_reused kept, which run
        before anything writes those GPU blocks; releases what this step's loads read."""

    @abstractmethod
    def copy_ahead(self, gpu: BlockPool, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """Copies (gpu, tier) of cached GPU blocks among the next `horizon` the free
        queue hands out, ahead of their reuse (at most max_blocks)."""

    @abstractmethod
    def mark_computed(self) -> None:
        """The step ran: the copies it made hold their data."""

    @abstractmethod
    def forget_uncomputed(self) -> int:
        """The step failed: what its copies were to fill is dropped. Returns how many."""

    @abstractmethod
    def record_hit(self, request_id: str, blocks: list, block_size: int,
                   from_below: int = 0) -> None:
        """A request's prompt continued on these blocks (said in an event); counted in
        hit_tokens but for `from_below` of them, which a tier below read back into this
        one (they are that tier's hits)."""


class CPUTier(PrefixTier):
    """The prefix cache's second level in the CPU pool."""
    medium = "CPU"

    def __init__(self, cpu: BlockPool, events: EventLog, uncomputed: set[int]) -> None:
        super().__init__()
        self.cpu = cpu  # shared with swapped-out requests
        self._events = events
        self._gpu_uncomputed = uncomputed  # GPU blocks the coming step writes (no copy yet)
        self._to_store: list[tuple[int, BlockHash]] = []  # GPU blocks reused this schedule
        self._held: list[KVBlock] = []  # CPU blocks this step's copies read
        self.uncomputed: list[KVBlock] = []  # CPU blocks this step's copies fill

    @property
    def capacity(self) -> int:
        return self.cpu.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self.cpu.cached)

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

    def note_reused(self, evicted: list[tuple[int, BlockHash]]) -> None:
        uncomputed = self._gpu_uncomputed  # (their data is not written: nothing to keep)
        self._to_store.extend(e for e in evicted if e[0] not in uncomputed)

    def flush(self) -> list[tuple[int, int]]:
        mapping: list[tuple[int, int]] = []
        if self._to_store:
            stored: list[KVBlock] = []
            cpu = self.cpu
            for gpu_id, block_hash in self._to_store:
                held = cpu.get_cached(block_hash)
                if held is not None:  # the tier has it already: it was used again
                    cpu.refresh(held)
                    continue
                if not cpu.num_free:  # every CPU block holds a swapped request
                    continue
                block = self._block_for(block_hash)
                stored.append(block)
                mapping.append((gpu_id, block.block_id))
            self._to_store.clear()
            self._stored(stored, "copied from GPU blocks about to be reused")
        if self._held:
            self.cpu.free(self._held)
            self._held = []
        return mapping

    def copy_ahead(self, gpu: BlockPool, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """Write-back ahead of need: the runner may copy these while this step's forward
        pass runs, as they are free (neither read nor written by it). When the pool
        reuses them later, flush finds their hash on the tier and copies nothing: the
        copy is off that step's critical path. Call after flush, for a step that runs."""
        mapping: list[tuple[int, int]] = []
        stored: list[KVBlock] = []
        cpu, uncomputed, seen = self.cpu, self._gpu_uncomputed, 0
        for block in gpu.free_queue:
            if seen == horizon or len(stored) == max_blocks:
                break
            seen += 1
            block_hash = block.block_hash
            if block_hash is None or block.block_id in uncomputed \
                    or cpu.get_cached(block_hash) is not None:
                continue
            if not cpu.num_free:
                break
            target = self._block_for(block_hash)
            stored.append(target)
            mapping.append((block.block_id, target.block_id))
        self._stored(stored, "copied ahead from GPU blocks next in line for reuse")
        return mapping

    def _block_for(self, block_hash: BlockHash) -> KVBlock:
        """A CPU block registered under the hash, free and the tier's most recently used
        (the caller checked that one is free)."""
        block = self.cpu.take_new(1)[0]
        self.cpu.cache(block, block_hash)
        self.cpu.free([block])
        return block

    def _stored(self, stored: list[KVBlock], how: str) -> None:
        """Account for CPU blocks the coming copies fill (counted, said, and forgotten
        again if the step fails)."""
        if not stored:
            return
        self.num_blocks_stored += len(stored)
        self.uncomputed.extend(stored)
        self._events.emit("BlockStored", pool="cpu", block_ids=[b.block_id for b in stored],
                          block_hashes=[short(b.block_hash) for b in stored],
                          ref_cnts=[0] * len(stored), detail=f"CPU tier: {how}",
                          hashes=[b.block_hash for b in stored] if self._events.full else None)

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

    def held(self) -> list[KVBlock]:
        """CPU blocks this step's loads read (each holds a reference until flush, so that
        no copy of the same step overwrites them)."""
        return self._held
