"""One layer group's block tables, by attention kind (vLLM's single-type managers).

A group owns, per request, its GPU block table (and its CPU table while swapped out),
which of its full blocks it has offered to the prefix cache, and, for a fork's samples,
whether the partly filled last block is still shared. It asks the pools for blocks and
gives them back; it never chooses a victim (the scheduler does) and never decides for
other groups (the coordinator, engine/kv/coordinator.py, runs all-or-nothing allocation,
prefix hits across groups, forks, swaps and frees over every group).

Two kinds:
* FullAttentionGroup: every token's K/V stays while the request holds it.
* SlidingWindowGroup: the group's layers attend only to the last `window` tokens, so a
  request's leading blocks that no future token can see go back to the pool (cached ones
  stay findable until reused). Its table then holds only the blocks from the first still
  visible one on: `req_to_blocks` lists live blocks, `window_freed` counts the freed
  ones before them, and the ids the runner gets (step_block_ids) put -1 in their places,
  so that table position = token // block_size.

Group 0 caches its blocks under the request's prefix hashes (which routers and pins
know); another group under hashes of its own (kv_layout.group_hash), so that a prefix
hit finds each group's blocks for the same tokens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from engine.block_hash import BlockHash, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.block_seconds import BlockSeconds
from engine.kv.events import EventLog
from engine.kv.layout import cdiv, group_hash
from engine.request import Request


@dataclass(slots=True)
class GroupHit:
    """A group's part of a prefix hit."""
    blocks: list[KVBlock]  # its cached blocks, in table order (after `skip` places)
    cow: bool  # the last of them will be written: it is copied first
    # Leading table places not held: blocks a sliding window no longer reaches
    skip: int = 0


@dataclass(slots=True)
class Allocation:
    """What an allocation did, for the model runner."""
    new_blocks: list[KVBlock] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    copies_in: list[tuple[int, int]] = field(default_factory=list)  # (tier, gpu): tier hits


# The decode fast path's answer: nothing allocated (never modified)
NOTHING_ALLOCATED = Allocation()
# allocate(..., quota=True)'s answer when a running request's next blocks would take free
# cached blocks another tenant keeps under its cache quota (BlockPool.room_for): nothing
# changed; the scheduler decides who gives way (never modified)
OVER_QUOTA = Allocation()


@dataclass(slots=True)
class SwapResult:
    mapping: list[tuple[int, int]]  # (src block, dst block) to copy, src pool -> dst pool
    num_hit_blocks: int = 0  # swap-in only: blocks found in the prefix cache, not copied


class KVGroup:
    """The tables of one layer group, in pools shared with the other groups."""
    window: int | None = None  # the group's sliding window (None: full attention)

    def __init__(self, group: int, block_size: int, gpu: BlockPool, cpu: BlockPool,
                 events: EventLog, uncomputed: set[int], held: BlockSeconds) -> None:
        self.group = group
        self.block_size = block_size
        self.enable_caching = gpu.enable_caching
        self.gpu, self.cpu = gpu, cpu  # owned by the coordinator
        self._events = events
        # GPU blocks registered in the cache during this schedule, whose K/V the coming
        # forward pass writes (owned by the coordinator, shared by its groups)
        self._uncomputed = uncomputed
        # requests' block-seconds (owned by the coordinator): told each change of a
        # table's length, in every group
        self._held = held
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # GPU block table
        self.req_to_cpu_blocks: dict[str, list[KVBlock]] = {}  # CPU table while swapped
        self._num_offered: dict[str, int] = {}  # leading blocks already offered to the cache
        self._window_freed: dict[str, int] = {}  # leading blocks a request gave back
        # Samples of a fork whose partly filled last block may still be shared: the first
        # write into it copies it (allocate).
        self._shared_tail: set[str] = set()
        self._step_ids: dict[str, tuple[list, list[int]]] = {}  # step_block_ids cache
        # events of this group's blocks say which group they are (group 0: unsaid)
        self._emit = functools.partial(events.emit, group=group) if group else events.emit

    # --- prefix hits -----------------------------------------------------------------
    def keys(self, request: Request, start: int, end: int) -> list[BlockHash]:
        """The cache keys of the request's full blocks [start, end) in this group."""
        hashes = request.block_hashes[start:end]
        return [group_hash(h, self.group) for h in hashes] if self.group else hashes

    def key_of(self, block_hash: BlockHash) -> BlockHash:
        """This group's cache key for the tokens a group-0 hash names."""
        return group_hash(block_hash, self.group) if self.group else block_hash

    def window_start(self, num_computed: int, length: int) -> int:
        """The first of a prefix's `length` blocks this group needs for the token at
        position num_computed: all of them for full attention."""
        return 0

    # --- allocation ------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int,
                      hit: GroupHit | None = None) -> int:
        """The free blocks allocate(request, num_new_tokens, hit) would take now (new
        ones, and cached ones it revives), after giving back the blocks out of the
        window as it does."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if self.window is not None and hit is None and table:
            self._free_out_of_window(request)
            table = self.req_to_blocks[rid]
        table = table or []
        total_tokens = request.num_computed_tokens + num_new_tokens
        freed = (hit.skip if hit is not None and hit.skip and not table
                 else self._window_freed.get(rid, 0))
        num_new = cdiv(total_tokens, self.block_size) - len(table) - freed
        if rid in self._shared_tail and table[-1].ref_cnt > 1:
            return 1 + max(num_new, 0)  # (a copy of the shared last block)
        reuse = hit.blocks[:-1] if hit is not None and hit.cow else \
            (hit.blocks if hit is not None else ())
        return max(num_new - len(reuse), 0) + sum(1 for b in reuse if b.ref_cnt == 0)

    def allocate(self, request: Request, num_new_tokens: int,
                 hit: GroupHit | None = None, quota: bool = False) -> Allocation | None:
        """Give the request room for num_new_tokens more tokens after its computed ones.

        On admission, `hit` holds this group's cached blocks to reuse and
        request.num_computed_tokens must already count them. Returns None, changing
        nothing, when the GPU pool has too few free blocks; with `quota` (a running
        request, a cache quota in force), OVER_QUOTA, changing nothing, when its new
        blocks would take another tenant's kept under its quota.
        """
        rid = request.request_id
        if self.window is not None and hit is None and rid in self.req_to_blocks:
            self._free_out_of_window(request)
        if rid in self._shared_tail:
            return self._allocate_unshared(request, num_new_tokens)
        table = self.req_to_blocks.get(rid, [])
        if hit is not None and hit.skip and not table:
            self._window_freed[rid] = hit.skip  # (places before the window: not held)
        freed = self._window_freed.get(rid, 0) if self._window_freed else 0
        total_tokens = request.num_computed_tokens + num_new_tokens
        if hit is None and table and cdiv(total_tokens, self.block_size) <= len(table) + freed:
            # Decode fast path: the last block still has room.
            if total_tokens // self.block_size > self._num_offered[rid]:
                self._offer_to_cache(request, total_tokens)
            return NOTHING_ALLOCATED
        reuse: list[KVBlock] = []
        cow_src: KVBlock | None = None
        if hit is not None and hit.blocks:
            if table:
                raise RuntimeError(f"invariant: prefix match for {rid}, which holds blocks")
            reuse = list(hit.blocks)
            if hit.cow:
                cow_src = reuse.pop()
        num_new_blocks = cdiv(total_tokens, self.block_size) - len(table) - freed - len(reuse)
        num_revived = sum(1 for b in reuse if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.gpu.num_free:
            return None
        if quota and not self.gpu.within_quota(request.tenant, num_new_blocks):
            return OVER_QUOTA
        # (an admission: a tenant over its cache quota passes over the free cached blocks
        # of the others under theirs; the coordinator counted its room without them)
        admitting = request.tenant if hit is not None else None

        self.gpu.touch(reuse, request.priority)
        new_blocks = self.gpu.take_new(max(num_new_blocks, 0), rid, request.priority, admitting)
        table = self.req_to_blocks.setdefault(rid, table)
        table.extend(reuse)
        table.extend(new_blocks)
        self._held.change(rid, gpu=len(reuse) + len(new_blocks), tenant=request.tenant)
        if rid not in self._num_offered:
            self._num_offered[rid] = freed + len(reuse)
        result = Allocation(new_blocks=new_blocks)
        if cow_src is not None and cow_src is not new_blocks[0]:
            result.copies.append((cow_src.block_id, new_blocks[0].block_id))
        self._offer_to_cache(request, total_tokens)
        return result

    def hold(self, request: Request, cached: list[KVBlock], num_new: int) -> list[KVBlock] | None:
        """A table for a request being copied here from another engine: its leading
        `cached` blocks (a reference each) and num_new fresh ones, which are offered to
        the prefix cache only once their data is in and the request runs (its next
        allocate). None, changing nothing, when the pool is short."""
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        if num_new + revived > self.gpu.num_free:
            return None
        request_id = request.request_id
        self.gpu.touch(cached)
        fresh = self.gpu.take_new(num_new, request_id)
        self.req_to_blocks[request_id] = [*cached, *fresh]
        self._held.change(request_id, gpu=len(cached) + len(fresh), tenant=request.tenant)
        self._num_offered[request_id] = len(cached)
        return fresh

    def adopt_table(self, request: Request, freed: int, num_blocks: int) -> list[KVBlock]:
        """A table of num_blocks fresh blocks for a request copied here from another
        engine whose first `freed` blocks a window gave back there (the coordinator has
        checked the room). Its full blocks are offered to the prefix cache once it runs
        (its next allocate), their data in by then."""
        request_id = request.request_id
        fresh = self.gpu.take_new(num_blocks, request_id)
        self.req_to_blocks[request_id] = fresh
        self._held.change(request_id, gpu=len(fresh), tenant=request.tenant)
        if freed:
            self._window_freed[request_id] = freed
        self._num_offered[request_id] = freed
        return fresh

    def _free_out_of_window(self, request: Request) -> None:
        """A sliding group gives back the blocks its window passed (SlidingWindowGroup)."""

    def window_freed(self, request_id: str) -> int:
        """Leading blocks the request gave back because the window no longer reaches them."""
        return self._window_freed.get(request_id, 0)

    @property
    def window_freed_counts(self) -> dict[str, int]:
        """window_freed of every request that gave blocks back (read-only use)."""
        return self._window_freed

    def fork(self, parent: Request, child: Request) -> None:
        """Give a sample of a fork the parent's blocks (one more reference each). Its
        partly filled last block, if any, stays shared until the sample writes into it."""
        table = self.req_to_blocks.get(parent.request_id, [])
        self.gpu.touch(table)
        self.req_to_blocks[child.request_id] = list(table)
        self._held.change(child.request_id, gpu=len(table), tenant=child.tenant)
        if parent.request_id in self._window_freed:
            self._window_freed[child.request_id] = self._window_freed[parent.request_id]
        self._num_offered[child.request_id] = self._num_offered.get(parent.request_id, 0)
        if parent.num_computed_tokens % self.block_size:
            self._shared_tail.add(child.request_id)

    def _allocate_unshared(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """allocate for a sample whose last block may be shared: if a sibling still
        holds it, this request writes into a copy (copy-on-write); the last holder keeps
        the original. None, changing nothing, when the pool is short."""
        rid = request.request_id
        table = self.req_to_blocks[rid]
        shared = table[-1]
        if shared.ref_cnt == 1:  # the others copied it or left: it is this request's alone
            self._shared_tail.discard(rid)
            return self.allocate(request, num_new_tokens)
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = max(cdiv(total_tokens, self.block_size) - len(table)
                             - self._window_freed.get(rid, 0), 0)
        if 1 + num_new_blocks > self.gpu.num_free:
            return None
        copy, *grown = self.gpu.take_new(1 + num_new_blocks, rid, request.priority)
        self.gpu.free([shared])  # this request's reference (a sibling still holds it)
        # a new list: a table replaced, not one that only grew (step_block_ids' cache)
        self.req_to_blocks[rid] = table = table[:-1] + [copy] + grown
        self._held.change(rid, gpu=len(grown))
        self._step_ids.pop(rid, None)
        self._shared_tail.discard(rid)
        self._emit("CopiedOnWrite", request_id=rid,
                   block_ids=[shared.block_id, copy.block_id],
                   ref_cnts=[shared.ref_cnt, copy.ref_cnt],
                   num_tokens=request.num_computed_tokens)
        self._offer_to_cache(request, total_tokens)
        return Allocation(new_blocks=[copy, *grown], copies=[(shared.block_id, copy.block_id)])

    def _offer_to_cache(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that will be full after num_tokens are computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.req_to_blocks[rid]
        freed = self._window_freed.get(rid, 0) if self._window_freed else 0
        start = max(self._num_offered[rid], freed)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        stored, indices = [], []
        hashes = self.keys(request, start, end)
        group, uncomputed = self.group, self._uncomputed
        for i in range(start, end):
            block = table[i - freed]
            if self.gpu.cache(block, hashes[i - start], request.tenant):
                block.group = group
                stored.append(block)
                indices.append(i)
                uncomputed.add(block.block_id)
        self._num_offered[rid] = max(start, end)
        if stored:
            # (the full chain only for a reader that asks, of group 0: routers' hashes)
            chain = self._chain(request, indices) if self._events.full and not group else {}
            self._emit("BlockStored", request_id=rid, tenant=request.tenant,
                       block_ids=[b.block_id for b in stored],
                       block_hashes=[short(b.block_hash) for b in stored],
                       ref_cnts=[b.ref_cnt for b in stored],
                       num_tokens=end * self.block_size, **chain)

    def _chain(self, request: Request, indices: list[int]) -> dict:
        """The full hashes, parents and token ids of the request's blocks at `indices`
        (a BlockStored for readers that rebuild the cache elsewhere)."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        return {"hashes": [hashes[i] for i in indices],
                "parents": [hashes[i - 1] if i else None for i in indices],
                "token_ids": [t for i in indices for t in tokens[i * bs:(i + 1) * bs]]}

    def free(self, request: Request, reason: str | None = None) -> None:
        """Release the request's GPU blocks, last block first (so a chain's tail is
        evicted before its head), and any CPU blocks it holds (reason: why, for the
        BlockRemoved events)."""
        rid = request.request_id
        self._num_offered.pop(rid, None)
        self._window_freed.pop(rid, None)
        self._shared_tail.discard(rid)
        table = self.req_to_blocks.pop(rid, [])
        self._step_ids.pop(rid, None)
        cpu_table = self.req_to_cpu_blocks.pop(rid, [])
        if table or cpu_table:
            self._held.change(rid, gpu=-len(table), cpu=-len(cpu_table))
        if table:
            self.gpu.free(reversed(table))
            self._emit("BlockRemoved", request_id=rid, reason=reason,
                       block_ids=[b.block_id for b in table],
                       ref_cnts=[b.ref_cnt for b in table])
        if cpu_table:
            self.cpu.free(reversed(cpu_table))
            self._emit("BlockRemoved", request_id=rid, pool="cpu", reason=reason,
                       block_ids=[b.block_id for b in cpu_table],
                       ref_cnts=[b.ref_cnt for b in cpu_table])

    # --- swap --------------------------------------------------------------------------
    def swap_out(self, request: Request) -> SwapResult | None:
        """Move the request's GPU blocks to new CPU blocks. None if the CPU pool is short."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        if rid in self.req_to_cpu_blocks:
            raise RuntimeError(f"invariant: {rid} is already swapped out")
        if len(table) > self.cpu.num_free:
            return None
        cpu_blocks = self.cpu.take_new(len(table), rid)
        mapping = [(g.block_id, c.block_id) for g, c in zip(table, cpu_blocks)]
        self.req_to_cpu_blocks[rid] = cpu_blocks
        self._num_offered.pop(rid, None)
        self._shared_tail.discard(rid)
        del self.req_to_blocks[rid]
        self._step_ids.pop(rid, None)
        self._held.change(rid, gpu=-len(table), cpu=len(cpu_blocks))
        self.gpu.free(reversed(table))  # cached ones stay findable until reused
        return SwapResult(mapping)

    def swap_in(self, request: Request) -> tuple[SwapResult, list[KVBlock]] | None:
        """Bring a swapped request's blocks back to the GPU pool. Leading blocks still in
        the prefix cache are reused instead of copied. None if the GPU pool is short;
        else the result and the CPU blocks its copies read (the caller releases them once
        the step's other copies are placed)."""
        rid = request.request_id
        cpu_table = self.req_to_cpu_blocks.get(rid)
        if cpu_table is None:
            raise RuntimeError(f"invariant: {rid} holds no CPU blocks")
        hits: list[KVBlock] = []
        if self.enable_caching and not self._window_freed.get(rid):  # (hits start at block 0)
            num_full = request.num_computed_tokens // self.block_size
            for key in self.keys(request, 0, num_full):
                block = self.gpu.get_cached(key)
                if block is None:
                    break
                hits.append(block)
        num_new = len(cpu_table) - len(hits)
        if num_new + sum(1 for b in hits if b.ref_cnt == 0) > self.gpu.num_free:
            return None
        self.gpu.touch(hits, request.priority)
        new_blocks = self.gpu.take_new(num_new, rid, request.priority)
        self.req_to_blocks[rid] = hits + new_blocks
        mapping = [(c.block_id, g.block_id) for c, g in zip(cpu_table[len(hits):], new_blocks)]
        del self.req_to_cpu_blocks[rid]
        self._held.change(rid, gpu=len(hits) + len(new_blocks), cpu=-len(cpu_table))
        self._num_offered[rid] = len(hits) + self._window_freed.get(rid, 0)
        self._offer_to_cache(request, request.num_computed_tokens)
        return SwapResult(mapping, num_hit_blocks=len(hits)), list(reversed(cpu_table))

    # --- introspection ---------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def cpu_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cpu_blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def num_cpu_blocks_held(self, request_id: str) -> int:
        return len(self.req_to_cpu_blocks.get(request_id, ()))

    def step_block_ids(self, request_id: str) -> list[int]:
        """The request's GPU block ids for this step's batch, without rebuilding the list
        every step: a table only grows (by extend) while its request holds it, so the
        ids list made last step is extended. The list is shared: read it, never keep
        it past the step."""
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return []
        cached = self._step_ids.get(request_id)
        if cached is None or cached[0] is not table:
            freed = self._window_freed.get(request_id, 0) if self._window_freed else 0
            cached = (table, [-1] * freed + [b.block_id for b in table])
            self._step_ids[request_id] = cached
        ids = cached[1]
        gap = len(table) - len(ids) + (self._window_freed.get(request_id, 0)
                                       if self._window_freed else 0)
        if gap > 0:
            ids.extend(b.block_id for b in table[len(table) - gap:])
        return ids


class FullAttentionGroup(KVGroup):
    """Every layer of the group attends to the whole context."""


class SlidingWindowGroup(KVGroup):
    """Every layer of the group attends to the last `window` tokens."""

    def __init__(self, group: int, block_size: int, gpu: BlockPool, cpu: BlockPool,
                 events: EventLog, uncomputed: set[int], held: BlockSeconds,
                 window: int) -> None:
        super().__init__(group, block_size, gpu, cpu, events, uncomputed, held)
        self.window = window

    def window_start(self, num_computed: int, length: int) -> int:
        """The block of position num_computed - window + 1, the furthest back the token
        at num_computed sees (the prefix's last block at most)."""
        return min(max(num_computed - self.window + 1, 0) // self.block_size, length - 1)

    def _free_out_of_window(self, request: Request) -> None:
        """Give back the request's leading blocks that its next token (at position
        num_computed_tokens) and every later one cannot see: those ending at or before
        position num_computed_tokens - window. The last block is always kept."""
        rid = request.request_id
        freed = self._window_freed.get(rid, 0)
        table = self.req_to_blocks[rid]
        first_visible = request.num_computed_tokens - self.window + 1
        n = min(first_visible // self.block_size - freed, len(table) - 1)
        if n <= 0:
            return
        gone, self.req_to_blocks[rid] = table[:n], table[n:]  # a new list: the table's
        self._window_freed[rid] = freed + n  # ids are rebuilt (step_block_ids)
        self._step_ids.pop(rid, None)
        self._held.change(rid, gpu=-n)
        self.gpu.free(reversed(gone))
        self._emit("WindowFreed", request_id=rid, block_ids=[b.block_id for b in gone],
                   block_hashes=[short(b.block_hash) for b in gone],
                   ref_cnts=[b.ref_cnt for b in gone],
                   num_tokens=(freed + n) * self.block_size, reason="window",
                   detail=f"out of the {self.window}-token window")


def make_group(group: int, window: int | None, block_size: int, gpu: BlockPool,
               cpu: BlockPool, events: EventLog, uncomputed: set[int],
               held: BlockSeconds) -> KVGroup:
    """The manager for a group of this attention kind (window None: full attention)."""
    if window is None:
        return FullAttentionGroup(group, block_size, gpu, cpu, events, uncomputed, held)
    return SlidingWindowGroup(group, block_size, gpu, cpu, events, uncomputed, held, window)
