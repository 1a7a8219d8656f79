"""The KV core: per-request block tables over every layer group, the prefix cache's
bookkeeping, and its tiers (vLLM's KVCacheCoordinator over its single-type managers).

The scheduler asks it "can this request get slots for n more tokens?" and gets blocks or
None; it never chooses a victim (the scheduler does). It owns:
* the pools (engine/kv/block_pool.py: blocks, reference counts, the free queue, the hash
  map), one GPU pool and one CPU pool shared by every group;
* one manager per layer group (engine/kv/group.py: full attention or sliding window),
  each owning that group's tables; a one-table model is one group;
* the chain of tiers below the GPU pool (engine/kv/tiers/base.py): the CPU tier
  (engine/kv/tiers/cpu.py), when the CPU pool is a second level of the prefix cache
  (EngineConfig.cpu_prefix_cache), then the disk tier (engine/kv/tiers/disk.py), either
  optional; it asks each the same questions, through PrefixTier only;
* the prefix cache's counters, and which GPU blocks the coming step writes.

Across groups it runs, all or nothing: prefix hits (the longest prefix every group can
serve), allocation (the room of every group counted before any takes a block), forks,
swaps and frees. Pins, evicts and resets act on group 0's prefix (the one pins and
routers know) and what the other groups need for it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Set as AbstractSet
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from engine.block_hash import BlockHash, hash_blocks, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.block_seconds import BlockSeconds
from engine.config import ConfigError
from engine.kv.events import EventLog
from engine.kv.export import PoolExport
from engine.kv.group import (NOTHING_ALLOCATED, OVER_QUOTA, Allocation, GroupHit, KVGroup,
                             SwapResult, make_group)
from engine.kv.tiers.base import TIER_POOLS, PrefixTier
from engine.kv.tiers.cpu import NO_CPU_TIER_METRICS, CPUTier
from engine.request import Request


@dataclass(slots=True)
class PrefixMatch:
    """Cached blocks found for a request about to be admitted."""
    groups: list[GroupHit]  # one per layer group
    num_computed_tokens: int  # tokens they cover, capped so the last token is computed
    # The blocks of the tier below the GPU that continue group 0's (copied into new GPU
    # blocks: lookup and load)
    tier_blocks: list = field(default_factory=list)
    story: object = None  # a first admission's KV story (engine/observe/story.py), if kept

    @property
    def blocks(self) -> list[KVBlock]:
        """Group 0's cached blocks (the request's table wherever one is shown)."""
        return self.groups[0].blocks

    @property
    def cow(self) -> bool:
        """Group 0's last cached block will be written: it is copied first."""
        return self.groups[0].cow


class KVCacheCoordinator:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 enable_caching: bool, events: EventLog,
                 windows: tuple[int | None, ...] = (None,),
                 cpu_prefix_cache: bool = False, eviction_policy: str = "lru",
                 disk_tier: Callable[[BlockPool, AbstractSet[int]], PrefixTier] | None = None,
                 tenant_cache_quota: float = 1.0) -> None:
        """windows: per layer group, its sliding window (None: full attention); one
        entry for a model with one table. A hybrid model's group 0 is a global group.
        disk_tier: builds the disk tier (engine/kv/tiers/disk.py) below a pool (the CPU
        tier's, or the GPU pool of an engine without one), given that pool's blocks whose
        data the coming step writes; None: no disk tier. tenant_cache_quota: each
        tenant's share of the GPU pool's cached blocks (engine/kv/tenant_cache.py)."""
        if len(windows) > 1 and windows[0] is not None:
            raise ValueError("a hybrid layout's group 0 is a global group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._events = events
        self.stories = None  # the engine's StoryBook (engine/observe/story.py), if it keeps one
        tier_on = cpu_prefix_cache and enable_caching and num_cpu_blocks > 0 and len(windows) == 1
        self.gpu = BlockPool(num_gpu_blocks, enable_caching, events, "gpu", eviction_policy,
                             tenant_cache_quota=tenant_cache_quota)
        # (as a tier, the CPU pool counts its cached blocks per tenant: no quota there)
        self.cpu = BlockPool(num_cpu_blocks, tier_on, events, "cpu",
                             tenant_cache_quota=1.0 if tier_on else None)
        # Blocks registered in the cache during this schedule, whose K/V the coming
        # forward pass writes. A same-step hit may read them (each layer writes all K/V
        # before attending) but not copy them: copies run before the forward pass.
        self.uncomputed: set[int] = set()
        # each request's KV block-seconds by pool, told by the groups as tables change
        # (the event log's clock, the stories' time, read when it is asked)
        self.block_seconds = BlockSeconds(lambda: events.clock())
        self.groups: list[KVGroup] = [
            make_group(g, w, block_size, self.gpu, self.cpu, events, self.uncomputed,
                       self.block_seconds)
            for g, w in enumerate(windows)]
        self.main = self.groups[0]
        self.num_groups = len(self.groups)
        self.cpu_tier = tier_on  # the CPU pool is a level of the prefix cache too
        # The tiers below the GPU pool, top down (the CPU tier, then the disk)
        self.tiers: list[PrefixTier] = self._chain(tier_on, disk_tier)
        # The step's hot path, once per running request per step: room for a request that
        # runs already (no hit to place), and its table's ids for the step. With one group
        # these are that group's own methods, without a call in between.
        self.allocate_more = self.main.allocate if self.num_groups == 1 else self._allocate_more
        self.step_block_ids = self.main.step_block_ids
        self._cpu_held: list[KVBlock] = []  # CPU blocks this step's swap-ins read
        # export_pool's memo, per pool: key -> (the table list, its length, its ids)
        self._exported: dict[str, dict] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0  # of which found cached on the GPU or a tier (tokens)

    def _chain(self, cpu_tier: bool, disk_tier: Callable | None) -> list[PrefixTier]:
        """The tiers below the GPU pool, top down, each offered the cached blocks the pool
        above it reuses (that pool's on_evict hook)."""
        tiers: list[PrefixTier] = []
        if cpu_tier:
            tiers.append(CPUTier(self.cpu, self.gpu, self._events, self.uncomputed))
        if disk_tier is not None:
            if not cpu_tier and self.num_groups > 1:
                raise ConfigError("a disk tier straight below the GPU pool of a model with "
                                  "layer groups is not supported: turn on the CPU tier "
                                  "(cpu_prefix_cache), or hybrid_kv_cache off")
            above = self.cpu if cpu_tier else self.gpu
            # (the coming step's GPU blocks hold nothing yet: never written to disk)
            tiers.append(disk_tier(above, self.uncomputed if above is self.gpu else frozenset()))
        for tier in tiers:
            tier.above.on_evict = tier.offer
        return tiers

    # --- what the engine and the viewers read ----------------------------------------
    @property
    def sliding_window(self) -> int | None:
        """Every layer's window (one group that slides), or None."""
        return self.main.window if self.num_groups == 1 else None

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:
        """Group 0's tables: the request's table wherever one table is shown."""
        return self.main.req_to_blocks

    @property
    def req_to_cpu_blocks(self) -> dict[str, list[KVBlock]]:
        return self.main.req_to_cpu_blocks

    def window_freed(self, request_id: str) -> int:
        """Leading blocks group 0's table gave back (a model whose every layer slides)."""
        return self.main.window_freed(request_id)

    @property
    def window_freed_counts(self) -> dict[str, int]:
        return self.main.window_freed_counts

    def group_tables(self, pool: str = "gpu") -> list[tuple[int, dict[str, list[KVBlock]]]]:
        """(group, its tables by request id) of the groups other than 0: their blocks
        are the requests' too (owners, reference counts)."""
        return [(g.group, g.req_to_blocks if pool == "gpu" else g.req_to_cpu_blocks)
                for g in self.groups[1:]]

    def tier_metrics(self, block_bytes: int) -> dict:
        """Each tier's counters, top down, by their /metrics names (the CPU tier's are
        there, at 0, on an engine without one; the disk's only with it)."""
        out = {} if self.cpu_tier else dict(NO_CPU_TIER_METRICS)
        for tier in self.tiers:
            out.update(tier.metrics(block_bytes))
        return out

    def block_ids(self, request_id: str) -> list[int]:
        return self.main.block_ids(request_id)

    def cpu_block_ids(self, request_id: str) -> list[int]:
        return self.main.cpu_block_ids(request_id)

    def group_step_block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's table for this step's batch (-1 where a window gave a block back)."""
        return [g.step_block_ids(request_id) for g in self.groups]

    def num_blocks_held(self, request_id: str) -> int:
        """GPU blocks the request holds, in every group's table."""
        return sum(g.num_blocks_held(request_id) for g in self.groups)

    def num_cpu_blocks_held(self, request_id: str) -> int:
        return sum(g.num_cpu_blocks_held(request_id) for g in self.groups)

    def num_blocks_held_by(self, request_ids: Iterable[str]) -> int:
        """GPU blocks the requests hold together, in every group's table: a block shared
        among them (a prefix hit, a fork's samples) counts once."""
        request_ids = list(request_ids)
        return sum(len(set(chain.from_iterable(g.req_to_blocks.get(rid, ())
                                               for rid in request_ids)))
                   for g in self.groups)

    def num_blocks_freed_by(self, request_id: str) -> int:
        """GPU blocks that would go back to the free queue if the request let go of its
        blocks now: those no other holder (a request, a pin) keeps."""
        return sum(1 for g in self.groups for b in g.req_to_blocks.get(request_id, ())
                   if b.ref_cnt == 1)

    # --- admission -------------------------------------------------------------------
    def find_prefix(self, request: Request) -> PrefixMatch:
        """_find_prefix, and at a first admission the story of what it found and why
        (told now, before the request takes any block)."""
        match = self._find_prefix(request)
        if self.stories is not None and request.num_cached_tokens is None:
            off = None if self.enable_caching else "prefix caching is off on this engine"
            if off is None and request.sampling_params.prompt_logprobs is not None:
                off = "its prompt's logprobs need every position computed: no cache is read"
            # per tier, the blocks of the level above it that it read back there
            read_back = [tier.read_back_among(blocks)
                         for tier, blocks in zip(self.tiers, self._levels(match))] or [0]
            # (blocks read back into the GPU pool are told as the tiers', not the GPU's)
            gpu = len(match.groups[0].blocks) - read_back[0]
            below = len(match.tier_blocks) + read_back[0]
            match.story = self.stories.draft(
                request, gpu, below, match.num_computed_tokens, self.cached_where, off,
                windowed=self.num_groups > 1, disk_blocks=sum(read_back))
        return match

    @staticmethod
    def _levels(match: PrefixMatch) -> list[list[KVBlock]]:
        """A match's blocks by level: group 0's on the GPU, then the tier's below it."""
        return [match.groups[0].blocks, match.tier_blocks]

    def _find_prefix(self, request: Request) -> PrefixMatch:
        """The longest prefix every group can serve, from the GPU pool and then the tier:
        group 0's leading cached blocks, shortened until each sliding group holds the
        blocks its window reaches from the first token to compute, and each other global
        group every block. A hit always leaves the last token to compute (its logits are
        needed); when it covers every token, that token is rewritten in a copy of the
        last block."""
        nothing = PrefixMatch([GroupHit([], False) for _ in self.groups], 0)
        if not self.enable_caching or (request.sampling_params.prompt_logprobs is not None
                                       and len(request.prompt_logprobs) < request.num_prompt_tokens):
            return nothing  # (its prompt's logprobs need every position)
        blocks = self._run(0, request.block_hashes)
        if request.pinned_root is not None and self.gpu.num_pinned:
            shared = self._pinned_prefix(request)
            if len(shared) > len(blocks):
                blocks = shared  # its own later blocks are still cached under its salt
        tier_blocks = self._run(1, request.block_hashes[len(blocks):]) if self.tiers else []
        covered = (len(blocks) + len(tier_blocks)) * self.block_size
        if covered >= request.num_tokens and tier_blocks:
            tier_blocks.pop()  # the last token's block is computed, not copied in
            covered -= self.block_size
        elif covered >= request.num_tokens and blocks[-1].block_id in self.uncomputed:
            blocks.pop()  # it would need a copy of data not written yet: recompute it
            covered -= self.block_size
        num_computed = min(covered, request.num_tokens - 1)
        first = PrefixMatch([GroupHit(blocks, covered > num_computed)], num_computed,
                            tier_blocks)
        if self.num_groups == 1:
            return first
        return self._across_groups(request, first) if blocks else nothing

    def _run(self, level: int, hashes: list[BlockHash]) -> list[KVBlock]:
        """The leading run of these hashes that a level holds (0: the GPU pool; i: the
        i-th tier's blocks for load), continued by what the tier below it reads back
        into it (holding the run meanwhile)."""
        lookup = self._cached_run if level == 0 else self.tiers[level - 1].lookup
        run = lookup(hashes)
        if level < len(self.tiers) and len(run) < len(hashes) and \
                self.tiers[level].promote(run, hashes[len(run):]):
            run = lookup(hashes)
        return run

    def read_ahead(self, hashes: list[BlockHash]) -> None:
        """A request arrived: each tier is told its blocks that no level above it holds
        (a tier slow to read, the disk, starts reading them, so that its admission finds
        them in memory)."""
        missing, held_above = hashes, self.gpu.cached.__contains__
        for tier in self.tiers:
            missing = [h for h in missing if not held_above(h)]
            tier.read_ahead(missing)
            held_above = tier.holds

    def _cached_run(self, hashes: list[BlockHash]) -> list[KVBlock]:
        out = []
        get = self.gpu.get_cached
        for block_hash in hashes:
            block = get(block_hash)
            if block is None:
                break
            out.append(block)
        return out

    def _pinned_prefix(self, request: Request) -> list[KVBlock]:
        """The leading pinned blocks of the request's tokens in the unsalted chain."""
        return self._pinned_run(hash_blocks(request.pinned_root, request.all_token_ids,
                                            self.block_size))

    def _pinned_run(self, hashes: list[BlockHash]) -> list[KVBlock]:
        out = []
        for block_hash in hashes:
            block = self.gpu.get_cached(block_hash)
            if block is None or not block.pinned:
                break
            out.append(block)
        return out

    def _across_groups(self, request: Request, first: PrefixMatch) -> PrefixMatch:
        """Group 0's hit, as long as every other group can serve it."""
        nothing = PrefixMatch([GroupHit([], False) for _ in self.groups], 0)
        found_blocks = first.groups[0].blocks
        bs, n = self.block_size, len(found_blocks)
        # Per other group: its cached block at each index below n, or None; keyed by the
        # hashes of group 0's blocks (the request's, or a pinned prefix's unsalted chain)
        matched = [b.block_hash for b in found_blocks]
        cached = [[g.gpu.get_cached(g.key_of(h)) for h in matched] for g in self.groups[1:]]
        for length in range(n, 0, -1):
            num_computed = min(length * bs, request.num_tokens - 1)
            cow = length * bs > num_computed
            found = self._groups_at(cached, length, num_computed, cow)
            if found is not None:
                hits = [GroupHit(found_blocks[:length], cow)] + found
                break
        else:
            return nothing
        if cow and any(h.blocks and h.blocks[-1].block_id in self.uncomputed for h in hits):
            # a copy of data the coming step writes: the last block is recomputed instead
            length -= 1
            num_computed = length * bs
            found = self._groups_at(cached, length, num_computed, False) if length else None
            if found is None:
                return nothing
            hits = [GroupHit(found_blocks[:length], False)] + found
        return PrefixMatch(hits, num_computed)

    def _groups_at(self, cached: list[list[KVBlock | None]], length: int, num_computed: int,
                   cow: bool) -> list[GroupHit] | None:
        """The other groups' hits for a hit of `length` blocks, or None if one lacks a
        block it needs."""
        out = []
        for group, blocks in zip(self.groups[1:], cached):
            skip = group.window_start(num_computed, length)
            needed = blocks[skip:length]
            if any(b is None for b in needed):
                return None
            out.append(GroupHit(list(needed), cow, skip=skip))
        return out

    def record_prefix_query(self, request: Request, match: PrefixMatch) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += match.num_computed_tokens
        if match.story is not None:
            self.stories.admitted(request, match.story)
        blocks = match.groups[0].blocks
        if blocks:
            self._events.emit("PrefixHit", request_id=request.request_id,
                              block_ids=[b.block_id for b in blocks],
                              block_hashes=[short(b.block_hash) for b in blocks],
                              ref_cnts=[b.ref_cnt for b in blocks],
                              num_tokens=len(blocks) * self.block_size
                              if match.tier_blocks else match.num_computed_tokens)
        # Each tier counts its own hits: blocks the disk read back into the CPU tier pass
        # through it but are the disk's, so every reader takes one counter per tier.
        loaded = len(match.tier_blocks) * self.block_size
        served = (match.num_computed_tokens - loaded, loaded)  # tokens, per level
        read_back = [tier.count_read_back(blocks, self.block_size, n) if blocks else 0
                     for tier, blocks, n in zip(self.tiers, self._levels(match), served)]
        if match.tier_blocks:
            self.tiers[0].record_hit(request.request_id, match.tier_blocks, self.block_size,
                                     from_below=sum(read_back[1:]))
        for tier in self.tiers:
            tier.count_prompt(request.block_hashes)  # (blocks asked again go to disk)

    # --- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       match: PrefixMatch | None = None, quota: bool = True) -> Allocation | None:
        """Give the request room for num_new_tokens more tokens after its computed ones,
        in every group, or none (None: the GPU pool has too few free blocks; nothing
        changed). On admission, `match` (from find_prefix) holds the cached blocks to
        reuse and request.num_computed_tokens must already count them; quota: within
        the room its tenant's cache quota leaves it (False: a tenant's first request,
        which may take what it needs, as its oldest running request may)."""
        if match is not None and quota and request.tenant is not None:
            # a tenant over its cache quota is admitted only into the room it may take
            # (engine/kv/tenant_cache.py), counted once for every group
            room = self.gpu.room_for(request.tenant)
            if room < self.gpu.num_free and room < self.blocks_to_admit(request, num_new_tokens,
                                                                         match):
                return None
        if self.num_groups == 1:
            alloc = self.main.allocate(request, num_new_tokens,
                                       match.groups[0] if match is not None else None)
            if alloc is not None and match is not None and match.tier_blocks:
                # the first new blocks take the tier's data
                alloc.copies_in = self.tiers[0].load(match.tier_blocks, alloc.new_blocks)
            return alloc
        hits = match.groups if match is not None else [None] * self.num_groups
        if self.blocks_to_admit(request, num_new_tokens, match) > self.gpu.num_free:
            return None
        # Every group's reused blocks are held before any group takes new ones (which
        # could otherwise reuse a free cached block another group is about to revive).
        held = [b for h in hits if h is not None for b in (h.blocks[:-1] if h.cow else h.blocks)]
        self.gpu.touch(held)
        allocations = [g.allocate(request, num_new_tokens, h) for g, h in zip(self.groups, hits)]
        self.gpu.free(held)
        if any(a is None for a in allocations):
            raise RuntimeError(f"invariant: a layer group of {request.request_id} "
                               "found no room after the room was counted")
        if all(a is NOTHING_ALLOCATED for a in allocations):
            return NOTHING_ALLOCATED
        return Allocation(new_blocks=[b for a in allocations for b in a.new_blocks],
                          copies=[c for a in allocations for c in a.copies])

    def hold(self, request: Request, hashes: list[BlockHash], num_blocks: int) -> int | None:
        """A table of num_blocks for a request being copied here (engine/transfer/migration.py):
        the leading blocks of `hashes` cached here, held, and fresh ones for the rest (not
        findable by hash until the request runs). Returns how many were cached, or None
        when the pool is short. One layer group only."""
        cached = self.cached_chain(hashes[:num_blocks])
        fresh = self.main.hold(request, cached, num_blocks - len(cached))
        return None if fresh is None else len(cached)

    def tables_of(self, request_id: str) -> list[tuple[int, list[int]]]:
        """Per layer group: the leading blocks a window gave back, and the block ids the
        request holds after them."""
        return [(g.window_freed(request_id), g.block_ids(request_id)) for g in self.groups]

    def adopt_tables(self, request: Request,
                     layout: list[tuple[int, int]]) -> list[list[int]] | None:
        """Fresh tables, per layer group (freed, num_blocks) as tables_of gave them at
        another engine, for a request copied here (engine/transfer/migration.py); their block
        ids, or None, changing nothing, when the pool is short."""
        if len(layout) != self.num_groups:
            raise ValueError(f"{len(layout)} layer groups sent; this engine has {self.num_groups}")
        if sum(n for _, n in layout) > self.gpu.num_free:
            return None
        return [[b.block_id for b in g.adopt_table(request, freed, n)]
                for g, (freed, n) in zip(self.groups, layout)]

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """The free GPU blocks allocate_slots(request, num_new_tokens) would take now."""
        return sum(g.blocks_needed(request, num_new_tokens) for g in self.groups)

    def blocks_to_admit(self, request: Request, num_new_tokens: int,
                        match: PrefixMatch | None) -> int:
        """The free GPU blocks allocate_slots(request, num_new_tokens, match) would take
        now: new ones, and the free cached ones of `match` it revives (every group's)."""
        hits = match.groups if match is not None else [None] * self.num_groups
        return sum(g.blocks_needed(request, num_new_tokens, h) for g, h in zip(self.groups, hits))

    def cached_where(self, block_hash: BlockHash) -> str | None:
        """Where group 0's prefix cache holds this hash now: "gpu", the first tier that
        holds it ("cpu", "disk"), or None."""
        if self.gpu.get_cached(block_hash) is not None:
            return "gpu"
        for tier in self.tiers:
            if tier.holds(block_hash):
                return tier.pool
        return None

    def _allocate_more(self, request: Request, num_new_tokens: int,
                       quota: bool = False) -> Allocation | None:
        """allocate_more over several groups (quota: as KVGroup.allocate's)."""
        if quota and request.tenant is not None:
            need = self.blocks_needed(request, num_new_tokens)
            if need <= self.gpu.num_free and not self.gpu.within_quota(request.tenant, need):
                return OVER_QUOTA
        return self.allocate_slots(request, num_new_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        for g in self.groups:
            g.fork(parent, child)

    def free(self, request: Request, reason: str | None = None) -> None:
        """Release every group's blocks of the request (reason: why, for the event: its
        finish reason, a preemption's, or "forked")."""
        for g in self.groups:
            g.free(request, reason)

    def end(self, request_id: str) -> dict[str, float]:
        """The request is gone from this engine (ended, forked, moved away or given back;
        its blocks freed): its KV block-seconds by pool here, which are forgotten."""
        return self.block_seconds.end(request_id)

    # --- the step's copies -----------------------------------------------------------
    def flush_offloads(self) -> list[tuple[int, int]]:
        """End of a schedule (or of an operator's command that took GPU blocks): the
        tiers' copies of the GPU blocks this schedule reused (which must run before
        anything writes those GPU blocks: the step's swap-outs do), and the CPU blocks
        this step's copies read are released."""
        mapping = [copy for tier in self.tiers for copy in tier.flush()]
        if self._cpu_held:
            self.cpu.free(self._cpu_held)
            self._cpu_held = []
        return mapping

    def copy_ahead(self, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """The tiers' copies of cached GPU blocks next in line for reuse, which may run
        beside this step's forward pass (call after flush_offloads, for a step that runs)."""
        return [copy for tier in self.tiers for copy in tier.copy_ahead(horizon, max_blocks)]

    def mark_computed(self) -> None:
        """The step ran: the blocks registered for it hold their K/V."""
        self.uncomputed.clear()
        for tier in self.tiers:
            tier.mark_computed()

    def forget_uncomputed(self) -> int:
        """A step failed: the blocks registered for it hold no valid K/V. Drop their hashes."""
        dropped = self.gpu.forget_unwritten([self.gpu.blocks[b] for b in self.uncomputed])
        self.uncomputed.clear()
        for tier in self.tiers:
            tier.forget_uncomputed()
        return len(dropped)

    # --- swap --------------------------------------------------------------------------
    def swap_out(self, request: Request) -> SwapResult | None:
        """Move the request's GPU blocks, in every group, to new CPU blocks. None if the
        CPU pool is short."""
        rid = request.request_id
        need = sum(len(g.req_to_blocks.get(rid, ())) for g in self.groups)
        if need > self.cpu.num_free:
            return None
        results = [g.swap_out(request) for g in self.groups]
        return SwapResult([m for r in results for m in r.mapping])

    def swap_in(self, request: Request) -> SwapResult | None:
        """Bring a swapped request's blocks back to the GPU pool (leading blocks still in
        the prefix cache are reused, in the groups whose tables start at block 0). None
        if the GPU pool is short."""
        rid = request.request_id
        need = sum(len(g.req_to_cpu_blocks.get(rid, ())) for g in self.groups)
        if self.num_groups > 1 and need > self.gpu.num_free:  # (hits only lower it)
            return None
        mappings, hits = [], 0
        for g in self.groups:
            swapped = g.swap_in(request)
            if swapped is None:  # (one group: its own count, hits included)
                if g is not self.main:
                    raise RuntimeError(f"invariant: a layer group of {rid} found no room "
                                       "after the room was counted")
                return None
            result, read = swapped
            mappings += result.mapping
            if g is self.main:
                hits = result.num_hit_blocks
            # released by flush_offloads, once this step's offloads have their CPU blocks
            # (an offload must not overwrite a block that a swap-in of the same step reads)
            self._cpu_held.extend(read)
        return SwapResult(mappings, num_hit_blocks=hits)

    # --- operator: evict, reset, pin (group 0's prefix, and what other groups need) ------
    def evict(self, n: int | None, by: str | None = None) -> int:
        """An operator's evict (by: their name)."""
        return len(self.gpu.evict(n, by))

    def reset_prefix_cache(self, by: str | None = None) -> dict:
        unpinned = [b for b in self.gpu.blocks if b.pinned]
        for block in unpinned:
            self.gpu.unpin(block)
        n = self.gpu.forget_all_hashes()
        # every tier's blocks too: served after a reset, a poisoned block would outlive it
        forgotten = [(tier, tier.reset()) for tier in self.tiers]
        self._events.emit("AllBlocksCleared", num_tokens=n * self.block_size, reason="reset",
                          by=by or "operator",
                          detail=f"{n} cached blocks forgotten, {len(unpinned)} unpinned"
                          + "".join(f", {k} {tier.where}" for tier, k in forgotten if k))
        return {"num_blocks_forgotten": n, "num_blocks_unpinned": len(unpinned),
                **{f"num_{pool}_blocks_forgotten": 0 for pool in TIER_POOLS},
                **{f"num_{tier.pool}_blocks_forgotten": k for tier, k in forgotten}}

    def close(self) -> None:
        """The engine is closing: each tier finishes what is under way (the disk's writes)."""
        for tier in self.tiers:
            tier.close()

    def leading_cached(self, hashes: list[BlockHash],
                       shared: list[BlockHash] | None = None) -> dict[str, int]:
        """Where the leading cached run of this chain (group 0's) lies now, in blocks per
        level, top down, as an admission would find it (_find_prefix): the GPU pool's run
        (or, when longer, the pinned blocks of `shared`, the unsalted chain of the same
        tokens, which a salted request may use), then the blocks each tier holds in turn
        that continue it. Read-only: nothing is read back, touched or counted."""
        found = {"gpu": len(self._cached_run(hashes))}
        if shared is not None and self.gpu.num_pinned:
            found["gpu"] = max(found["gpu"], len(self._pinned_run(shared)))
        start = found["gpu"]
        for tier in self.tiers:
            n = 0
            while start + n < len(hashes) and tier.holds(hashes[start + n]):
                n += 1
            found[tier.pool] = n
            start += n
        return found

    def cached_chain(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Leading blocks of this hash chain that are cached now (group 0's)."""
        return self._cached_run(hashes)

    def pin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Pin a cached prefix (group 0's blocks, from block 0): the other groups' blocks
        a hit on it needs are pinned too. Returns group 0's newly pinned."""
        for g in self.groups[1:]:
            self._pin(g, self._same_tokens(g, blocks), True)
        return self._pin(self.main, blocks, True)

    def unpin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        for g in self.groups[1:]:
            self._pin(g, self._same_tokens(g, blocks), False)
        return self._pin(self.main, blocks, False)

    def soft_pin(self, blocks: list[KVBlock], priority: int, ttl_s: float) -> list[KVBlock]:
        """Soft-pin a cached prefix (BlockPool.soft_pin), in every group as pin() does;
        group 0's newly soft-pinned."""
        for g in self.groups[1:]:
            self.gpu.soft_pin(self._same_tokens(g, blocks), priority, ttl_s)
        return self.gpu.soft_pin(blocks, priority, ttl_s)

    def soft_unpin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        for g in self.groups[1:]:
            self.gpu.soft_unpin(self._same_tokens(g, blocks))
        return self.gpu.soft_unpin(blocks)

    def _pin(self, group: KVGroup, blocks: list[KVBlock], pin: bool) -> list[KVBlock]:
        """Pin (or unpin) a group's blocks; the ones whose pin changed, said in an event."""
        change = self.gpu.pin if pin else self.gpu.unpin
        changed = [b for b in blocks if change(b)]
        if changed:
            self._events.emit("Pinned" if pin else "Unpinned",
                              block_ids=[b.block_id for b in changed],
                              block_hashes=[short(b.block_hash) for b in changed],
                              ref_cnts=[b.ref_cnt for b in changed],
                              **({"group": group.group} if group.group else {}))
        return changed

    def _same_tokens(self, group: KVGroup, blocks: list[KVBlock]) -> list[KVBlock]:
        """Group `group`'s cached blocks for the tokens of group 0's prefix `blocks`: all
        of them, or for a sliding group those the window reaches from the prefix's end
        (what a prompt that continues it reads)."""
        skip = group.window_start(len(blocks) * self.block_size, len(blocks))
        found = (self.gpu.get_cached(group.key_of(b.block_hash)) for b in blocks[skip:])
        return [b for b in found if b is not None]

    # --- what viewers get ------------------------------------------------------------
    def export_pool(self, pool: str, index_of: dict[str, int], full_scan: bool,
                    pins: bool) -> PoolExport:
        """One pool as viewers may keep it (engine/kv/export.py): each live request's
        table as a read-only array of block ids (keyed by its index; (index, group) for
        the layer groups other than 0), and, if asked, the pinned blocks' ids and a copy
        of the hash map (hash -> block id). A table unchanged since the last export is
        the same array: only tables that grew or were replaced are read again."""
        blocks = self.gpu if pool == "gpu" else self.cpu
        memo = self._exported.setdefault(pool, {})
        kept: dict = {}
        tables = []
        for g in self.groups:
            each = g.req_to_blocks if pool == "gpu" else g.req_to_cpu_blocks
            for rid, table in each.items():
                index = index_of.get(rid)
                if index is None:
                    continue
                key = index if not g.group else (index, g.group)
                kept[key] = entry = _export_table(memo.get(key), table)
                tables.append((key, entry[2]))
        self._exported[pool] = kept
        cached = {h: b.block_id for h, b in blocks.cached.items()} if full_scan else None
        tenants = {b.block_id: b.tenant for b in blocks.cached.values() if b.tenant is not None} \
            if full_scan and blocks.tenants is not None else None
        pinned = [b.block_id for b in blocks.blocks if b.pinned] if pins else None
        return PoolExport(blocks.pool, blocks.num_blocks, tables, cached, pinned, tenants)

    # --- invariants ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise if any bookkeeping invariant is broken (used by tests and debug runs)."""
        gpu_tables = {(g.group, rid): t for g in self.groups for rid, t in g.req_to_blocks.items()}
        cpu_tables = {(g.group, rid): t for g in self.groups
                      for rid, t in g.req_to_cpu_blocks.items()}
        # CPU blocks this step's copies read hold a reference until flush_offloads
        cpu_held = self._cpu_held + [b for tier in self.tiers for b in tier.held()]
        for pool, tables, held in ((self.gpu, gpu_tables, []), (self.cpu, cpu_tables, cpu_held)):
            holders = Counter(b.block_id for table in tables.values() for b in table)
            holders.update(b.block_id for b in held)
            for table in tables.values():
                if len({b.block_id for b in table}) != len(table):
                    raise AssertionError(f"invariant: a {pool.pool} block table repeats a block")
            in_queue = {b.block_id for b in pool.free_queue}
            if len(in_queue) != len(pool.free_queue):
                raise AssertionError(f"invariant: {pool.pool} free queue length is wrong")
            for block in pool.blocks:
                expected = holders[block.block_id] + (1 if block.pinned else 0)
                if block.ref_cnt != expected:
                    raise AssertionError(
                        f"invariant: {pool.pool} block {block.block_id} ref_cnt {block.ref_cnt} "
                        f"!= {expected} holders")
                if (block.ref_cnt == 0) != (block.block_id in in_queue):
                    raise AssertionError(
                        f"invariant: {pool.pool} block {block.block_id} is free iff ref_cnt 0")
            if len(in_queue) + sum(1 for b in pool.blocks if b.ref_cnt > 0) != pool.num_blocks:
                raise AssertionError(f"invariant: {pool.pool} free + held != total")
            if pool.num_pinned != sum(b.pinned for b in pool.blocks):
                raise AssertionError(f"invariant: {pool.pool} pinned count is wrong")
            for block_hash, block in pool.cached.items():
                if block.block_hash != block_hash:
                    raise AssertionError(f"invariant: hash map points at block {block.block_id} "
                                         "holding another hash")
            if pool.tenants is not None:
                pool.tenants.check(pool.blocks)
        for g in self.groups[1:]:
            for rid, table in g.req_to_blocks.items():
                if rid not in self.main.req_to_blocks:
                    raise AssertionError(f"invariant: group {g.group} holds blocks for {rid}, "
                                         "group 0 none")
                held = len(table) + g.window_freed(rid)
                if held != len(self.main.req_to_blocks[rid]):
                    raise AssertionError(
                        f"invariant: group {g.group}'s table of {rid} covers {held} blocks, "
                        f"group 0's {len(self.main.req_to_blocks[rid])}")
        metered = self.block_seconds.held()
        for rid in {rid for _, rid in gpu_tables} | {rid for _, rid in cpu_tables} | set(metered):
            tables = (sum(len(gpu_tables.get((g.group, rid), ())) for g in self.groups),
                      sum(len(cpu_tables.get((g.group, rid), ())) for g in self.groups))
            if metered.get(rid, (0, 0)) != tables:
                raise AssertionError(f"invariant: the block-seconds of {rid} count "
                                     f"{metered.get(rid, (0, 0))} (GPU, CPU) blocks held, "
                                     f"its tables {tables}")


def _export_table(memo: tuple | None, table: list[KVBlock]) -> tuple:
    """(table, length, read-only ids) for export_pool: the memo's ids if the table is the
    same list with the same blocks, grown by its new blocks' ids if it only grew (tables
    grow by extend; a table that lost or changed blocks is a new list, or its first or
    last block differs), else read whole."""
    n = len(table)
    if memo is not None and memo[0] is table and n >= memo[1] and n:
        ids = memo[2]
        if n == memo[1] and ids[-1] == table[-1].block_id and ids[0] == table[0].block_id:
            return memo
        if n > memo[1] and memo[1] and ids[0] == table[0].block_id \
                and ids[-1] == table[memo[1] - 1].block_id:
            tail = np.fromiter((b.block_id for b in table[memo[1]:]), np.int32, n - memo[1])
            grown = np.concatenate([ids, tail])
            grown.flags.writeable = False
            return table, n, grown
    ids = np.fromiter((b.block_id for b in table), np.int32, n)
    ids.flags.writeable = False
    return table, n, ids
