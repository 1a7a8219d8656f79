"""Physical KV blocks: reference counts, the free queue, and the prefix-cache map.

BlockPool is the only owner of a block's ref_cnt, hash and place in the free queue.
The free queue is in eviction order: the head is taken first. A freed block without a
hash goes to the head (nothing is lost by reusing it); a freed cached block goes to the
tail, so cached blocks are evicted least-recently-freed first. A cached block stays in
the hash map at ref_cnt 0 until its slot is taken for something else (lazy eviction),
and a prefix hit takes it back out of the middle of the queue in O(1).

Hashes leave the cache here alone, and each departure is said here (a BlockEvicted with
its reason: reused for another request's blocks, an operator's evict, a failed step).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from engine.block_hash import BlockHash, short
from engine.kv.events import EventLog
from engine.kv.tenant_cache import TenantCache


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # holders: block tables plus one for a pin
    block_hash: BlockHash | None = None  # set while the block is in the prefix-cache map
    pinned: bool = False  # a pin holds one reference; pinned blocks are never evicted
    group: int = 0  # the layer group whose table last cached it (engine/kv/layout.py)
    # Free-queue links, owned by FreeBlockQueue; None when not in the queue.
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None
    # For the eviction policies other than LRU (RankedFreeQueue): times its cached data
    # was taken again, the most important priority (lowest value) among the requests
    # that held it, and the list of the free queue it is in
    hits: int = 0
    keep: int | None = None
    rank: int = 0
    # A soft pin (BlockPool.soft_pin): kept over every block not soft-pinned until
    # soft_until (the pool's clock), each hit renewing it by soft_ttl; by its priority
    # among soft pins (a lower value is kept longer). 0.0: none
    soft_until: float = 0.0
    soft_ttl: float = 0.0
    soft_priority: int = 0
    # The pool's clock when its last holder let it go (None: held now, or never held):
    # how long a cached block has waited for a request to take it back
    freed_at: float | None = None
    # The tenant whose request cached it (engine/kv/tenant_cache.py), while it is cached
    tenant: str | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def peek(self) -> KVBlock | None:
        """The block popleft would take (None: the queue is empty)."""
        return self._head.next_free if self._len else None

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise IndexError("free queue is empty")
        block = self._head.next_free
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None:
            raise RuntimeError(f"invariant: block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        if block.prev_free is not None:
            raise RuntimeError(f"invariant: block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = before, after
        before.next_free = block
        after.prev_free = block
        self._len += 1


class RankedFreeQueue:
    """The free queue of an eviction policy other than LRU: free blocks without a hash
    first (as FreeBlockQueue's head), then cached ones in ranks, the lowest rank taken
    first and least recently freed first within a rank. A block's rank is its policy's
    (`rank_of`) when it is freed. The same interface as FreeBlockQueue, O(ranks) a take."""

    def __init__(self, blocks: Iterable[KVBlock], num_ranks: int,
                 rank_of: Callable[[KVBlock], int]) -> None:
        self._lists = [FreeBlockQueue(()) for _ in range(num_ranks + 1)]  # [0]: no hash
        self._rank_of = rank_of
        self._len = 0
        for b in blocks:  # (in the order given: the uncached ones first among them)
            if b.block_hash is None:
                b.rank = 0
                self._lists[0].append(b)
                self._len += 1
            else:
                self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        for queue in self._lists:
            yield from queue

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def peek(self) -> KVBlock | None:
        for queue in self._lists:
            if len(queue):
                return queue.peek()
        return None

    def popleft(self) -> KVBlock:
        for queue in self._lists:
            if len(queue):
                self._len -= 1
                return queue.popleft()
        raise IndexError("free queue is empty")

    def append(self, block: KVBlock) -> None:
        block.rank = 1 + self._rank_of(block)
        self._lists[block.rank].append(block)
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        block.rank = 0
        self._lists[0].appendleft(block)
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        self._lists[block.rank].remove(block)
        self._len -= 1


# What stays in the prefix cache when blocks run out (EngineConfig.eviction_policy): the
# rank of a free cached block (lower: evicted sooner) and how many ranks there are.
# lru: least recently freed first (FreeBlockQueue). slru: blocks never taken again since
# they were cached first, then the ones hit (a scan of one-off prompts does not push out
# what came back). lfu: by times hit (8 classes), least recently freed first in a class.
# priority: by the most important priority among the requests that held it (scheduling
# priority: a lower value is more important), 0 in the middle: a high-priority request's
# prefix outlives the others'.
PRIORITY_MID = 8
EVICTION_POLICIES: dict[str, tuple[int, Callable[[KVBlock], int]] | None] = {
    "lru": None,
    "slru": (2, lambda b: 1 if b.hits else 0),
    "lfu": (8, lambda b: min(b.hits, 7)),
    "priority": (2 * PRIORITY_MID + 1, lambda b: max(0, min(
        2 * PRIORITY_MID, PRIORITY_MID - (b.keep or 0)))),
}


SOFT_RANKS = 2 * PRIORITY_MID + 1  # soft pins' ranks, above every policy's


def free_queue_for(policy: str, blocks: Iterable[KVBlock],
                   clock: Callable[[], float] | None = None):
    """The free queue of an eviction policy, holding these free blocks in order; with a
    clock, soft pins (while they last) rank above the policy's ranks."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}")
    ranked = EVICTION_POLICIES[policy]
    if clock is None:
        return FreeBlockQueue(blocks) if ranked is None else RankedFreeQueue(blocks, *ranked)
    num_ranks, rank_of = ranked or (1, lambda b: 0)

    def with_soft(block: KVBlock) -> int:
        if block.soft_until and block.soft_until > clock():
            return num_ranks + max(0, min(2 * PRIORITY_MID, PRIORITY_MID - block.soft_priority))
        return rank_of(block)

    return RankedFreeQueue(blocks, num_ranks + SOFT_RANKS, with_soft)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, events: EventLog,
                 pool: str = "gpu", eviction_policy: str = "lru",
                 clock: Callable[[], float] = time.monotonic,
                 tenant_cache_quota: float | None = None) -> None:
        """tenant_cache_quota: each tenant's share of this pool's cached blocks
        (engine/kv/tenant_cache.py; 1.0: no quota, None: no tenants' ledger at all, as
        the CPU pool)."""
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pool = pool  # "gpu" or "cpu", for events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.eviction_policy = eviction_policy
        self.free_queue = free_queue_for(eviction_policy, self.blocks)
        self.clock = clock  # soft pins' time to live
        self.soft_pinned: set[KVBlock] = set()  # blocks with a soft pin, live or lapsed
        self._soft_next = float("inf")  # the earliest a soft pin lapses
        self._ranks_soft = False  # the free queue ranks soft pins (since the first one)
        self.cached: dict[BlockHash, KVBlock] = {}  # hash -> the one block holding it
        self.num_pinned = 0  # blocks held by a pin: no request can ever have them
        # Told (block id, hash, tenant) of the cached blocks take_new is about to reuse,
        # before their data is overwritten (the tiers below: engine/kv/tiers/)
        self.on_evict: Callable[[list[tuple[int, BlockHash, str | None]]], None] | None = None
        self._events = events
        self.tenants = None if tenant_cache_quota is None else \
            TenantCache(num_blocks, tenant_cache_quota)

    # --- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, including cached at ref 0)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    @property
    def quota_active(self) -> bool:
        """Whether a tenant cache quota (everyone's or one tenant's) is in force."""
        return self.tenants is not None and self.tenants.active

    def room_for(self, tenant: str | None) -> int:
        """The free blocks `tenant` may take without going past its cache quota at
        another's expense: num_free, less the free cached blocks of tenants under their
        quotas beyond the room `tenant` has left under its own (engine/kv/tenant_cache.py)."""
        quota = self.tenants
        if quota is None or tenant is None or not quota.active:
            return self.num_free
        return self.num_free - quota.protected_from(tenant)

    def within_quota(self, tenant: str | None, n: int) -> bool:
        """Whether `tenant` may take n more free blocks: n <= room_for(tenant), which is
        counted only where the room it has left under its own quota is short of n."""
        quota = self.tenants
        if quota is None or tenant is None or not quota.active or n <= quota.headroom(tenant):
            return True
        return n <= self.room_for(tenant)

    def cached_by_tenant(self) -> dict[str, int]:
        """Cached blocks (held or free) per tenant that cached them; staff's and
        unlabelled requests' blocks are nobody's."""
        return dict(self.tenants.counts) if self.tenants is not None else {}

    def set_eviction_policy(self, policy: str) -> None:
        """Another eviction policy from now on: the free blocks, in their order, ranked
        by it (and by their soft pins, while any block has one)."""
        free = list(self.free_queue)
        for block in free:
            self.free_queue.remove(block)
        self.free_queue = free_queue_for(policy, free, self.clock if self._ranks_soft else None)
        self.eviction_policy = policy

    # --- soft pins ---------------------------------------------------------------------
    def soft_pin(self, blocks: list[KVBlock], priority: int, ttl_s: float) -> list[KVBlock]:
        """Keep these cached blocks over every block not soft-pinned for ttl_s, renewed
        by each hit (a lower priority value is kept longer among soft pins). They are
        still evicted when nothing else is left: a soft pin takes no block from a
        request. Returns the blocks newly soft-pinned."""
        if not self._ranks_soft:  # (from now on the queue ranks soft pins)
            self._ranks_soft = True
            self.set_eviction_policy(self.eviction_policy)
        until = self.clock() + ttl_s
        newly = []
        for block in blocks:
            if block.block_hash is None:
                continue
            if not block.soft_until:
                newly.append(block)
            block.soft_until, block.soft_ttl, block.soft_priority = until, ttl_s, priority
            self.soft_pinned.add(block)
            self._rerank(block)
        self._soft_next = min(self._soft_next, until)
        return newly

    def soft_unpin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        released = [b for b in blocks if b.soft_until]
        for block in released:
            self._clear_soft(block)
        return released

    def expire_soft_pins(self) -> int:
        """Soft pins whose time is up go back to their policy's rank; how many."""
        now = self.clock()
        if now < self._soft_next:
            return 0
        lapsed = [b for b in self.soft_pinned if b.soft_until <= now]
        for block in lapsed:
            self._clear_soft(block)
        self._soft_next = min((b.soft_until for b in self.soft_pinned), default=float("inf"))
        return len(lapsed)

    @property
    def num_soft_pinned(self) -> int:
        now = self.clock()
        return sum(1 for b in self.soft_pinned if b.soft_until > now)

    def _clear_soft(self, block: KVBlock) -> None:
        block.soft_until = block.soft_ttl = 0.0
        block.soft_priority = 0
        self.soft_pinned.discard(block)
        self._rerank(block)

    def _rerank(self, block: KVBlock) -> None:
        if block.ref_cnt == 0 and block.block_hash is not None:
            self.free_queue.remove(block)
            self.free_queue.append(block)

    def eviction_order(self, k: int) -> list[int]:
        """Ids of the next k blocks to be taken (cached ones among them lose their data)."""
        out = []
        for block in self.free_queue:
            if len(out) == k:
                break
            out.append(block.block_id)
        return out

    def eviction_place(self, block_id: int) -> tuple[int, int] | None:
        """Where a free cached block stands in the eviction order: (its place among the
        free cached blocks, 1 for the next to lose its data; how many there are), or None
        if it is not one. Walks the free queue: for a viewer's question, not a step."""
        place, cached = None, 0
        for block in self.free_queue:
            if block.block_hash is None:
                continue
            cached += 1
            if block.block_id == block_id:
                place = cached
        return None if place is None else (place, cached)

    def idle_s(self, block_id: int) -> float | None:
        """Seconds since the block's last holder let it go; None while it is held (or
        was never held)."""
        freed_at = self.blocks[block_id].freed_at
        return None if freed_at is None else max(0.0, self.clock() - freed_at)

    # --- allocation ------------------------------------------------------------------
    def take_new(self, n: int, for_request: str | None = None,
                 keep: int | None = None, admitting: str | None = None) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, evicting cached data lazily
        (for_request: whose new blocks they become, named in the eviction's event; keep:
        its priority, for the priority eviction policy; admitting: the tenant of a
        request being admitted, which passes over the blocks room_for counted out).

        The caller checks num_free first; asking for too many is a broken invariant.
        """
        if n > self.num_free:
            raise RuntimeError(f"invariant: asked {self.pool} pool for {n} blocks, {self.num_free} free")
        if self.soft_pinned:
            self.expire_soft_pins()
        taken, evicted, tenants = [], [], []
        quota = self.tenants if self.tenants is not None and self.tenants.active else None
        guard = admitting if quota is not None and admitting is not None and \
            quota.protected_from(admitting) else None
        for _ in range(n):
            block = self._next_free(quota, guard)
            if block.block_hash is not None:
                evicted.append((block, block.block_hash))
                tenants.append(block.tenant)
                self._drop_hash(block)
            block.ref_cnt = 1
            block.keep = keep
            block.freed_at = None
            taken.append(block)
        if evicted:
            if self.on_evict is not None:
                self.on_evict([(b.block_id, h, t) for (b, h), t in zip(evicted, tenants)])
            self._evicted(evicted, "reuse", "evicted", for_request)
        return taken

    def _next_free(self, quota: TenantCache | None, guard: str | None) -> KVBlock:
        """The free block take_new takes next: the free queue's head, unless that would
        evict cached data while a tenant over its quota has a free cached block (then
        that tenant's least recently freed one), or, admitting for an over-quota tenant
        (guard), the first in eviction order that is not another tenant's under quota."""
        if quota is not None:
            head = self.free_queue.peek()
            if head.block_hash is not None:
                victim = quota.victim(self.clock())
                if victim is None and guard is not None:
                    victim = next((b for b in self.free_queue
                                   if quota.takeable_by(b, guard)), None)
                if victim is not None:
                    self.free_queue.remove(victim)
                    quota.num_taken += 1
                    return victim
        return self.free_queue.popleft()

    def touch(self, blocks: Iterable[KVBlock], keep: int | None = None,
              hit: bool = True) -> None:
        """Add a reference to each block (a prefix hit), reviving ref-0 cached blocks
        (keep: the priority of the request taking them, for the priority policy; hit:
        False to hold them a moment without counting a hit)."""
        tenants = self.tenants
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if tenants is not None and block.tenant is not None:
                    tenants.taken(block)
            block.ref_cnt += 1
            block.freed_at = None
            if hit and block.block_hash is not None:  # (cached data taken again)
                block.hits += 1
                if block.soft_until:  # a hit renews its soft pin
                    block.soft_until = max(block.soft_until, self.clock() + block.soft_ttl)
            if keep is not None and (block.keep is None or keep < block.keep):
                block.keep = keep

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"invariant: {self.pool} block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.freed_at = self.clock()
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    if block.tenant is not None:
                        self.tenants.freed(block)

    # --- prefix cache ----------------------------------------------------------------
    def cache(self, block: KVBlock, block_hash: BlockHash, tenant: str | None = None) -> bool:
        """Register a full block under its hash (tenant: whose request computed it).
        False if the hash is already cached (the block then stays uncached: one block
        per hash) or caching is off."""
        if not self.enable_caching or block_hash in self.cached or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if tenant is not None and self.tenants is not None:
            block.tenant = tenant
            self.tenants.cached(block)
        return True

    def refresh(self, block: KVBlock) -> None:
        """A free cached block becomes the most recently used (evicted last)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.append(block)
            if block.tenant is not None:
                self.tenants.refreshed(block)

    def evict(self, n: int | None = None, by: str | None = None) -> list[tuple[KVBlock, BlockHash]]:
        """An operator's evict: drop the data of up to n ref-0 cached blocks (all if
        None), LRU first. The blocks move to the head of the free queue, as any uncached
        free block. Returns each victim with the hash it had."""
        victims = []
        for block in self.free_queue:
            if n is not None and len(victims) == n:
                break
            if block.block_hash is not None:
                victims.append((block, block.block_hash))
        for block, _ in victims:
            self.forget(block)
        self._evicted(victims, "operator", "operator_evict", by or "operator")
        return victims

    def forget_unwritten(self, blocks: Iterable[KVBlock]) -> list[tuple[KVBlock, BlockHash]]:
        """A step failed: these blocks registered for it hold no valid K/V. Their hashes
        leave the cache; returns each with the hash it had."""
        dropped = []
        for block in blocks:
            block_hash = block.block_hash
            if self.forget(block):
                dropped.append((block, block_hash))
        self._evicted(dropped, "step failed", "step_failed", None)
        return dropped

    def _evicted(self, evicted: list[tuple[KVBlock, BlockHash]], detail: str, reason: str,
                 by: str | None) -> None:
        """Say that these (block, the hash it had) left the cache: one event per layer
        group among them (a group's hashes are its own)."""
        if not evicted or not self._events.on:
            return
        groups = {b.group for b, _ in evicted}
        for group in sorted(groups):
            these = evicted if len(groups) == 1 else [e for e in evicted if e[0].group == group]
            self._events.emit("BlockEvicted", pool=self.pool, detail=detail, reason=reason,
                              by=by, group=group, block_ids=[b.block_id for b, _ in these],
                              block_hashes=[short(h) for _, h in these],
                              # (reused: the hash left a free block, now another's)
                              ref_cnts=[0] * len(these) if reason == "evicted"
                              else [b.ref_cnt for b, _ in these],
                              hashes=[h for _, h in these] if self._events.full else None)

    def forget(self, block: KVBlock) -> bool:
        """Make one block unfindable by hash (its data is not what the hash says)."""
        if block.block_hash is None:
            return False
        self._drop_hash(block)
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        return True

    def forget_all_hashes(self) -> int:
        """Reset: no block is findable by hash any more. Returns how many were cached."""
        n = len(self.cached)
        for block in list(self.cached.values()):
            self.forget(block)
        return n

    def _drop_hash(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is not block:
            raise RuntimeError(f"invariant: block {block.block_id} hash not in the map")
        del self.cached[block.block_hash]
        block.block_hash = None
        block.hits = 0
        if block.tenant is not None:
            self.tenants.uncached(block)
            block.tenant = None
        if block.soft_until:  # (its data is gone: so is its soft pin)
            block.soft_until = block.soft_ttl = 0.0
            block.soft_priority = 0
            self.soft_pinned.discard(block)

    # --- pins ------------------------------------------------------------------------
    def pin(self, block: KVBlock) -> bool:
        """Hold one reference for a pin. False if the block was pinned already."""
        if block.pinned:
            return False
        self.touch([block])
        block.pinned = True
        self.num_pinned += 1
        return True

    def unpin(self, block: KVBlock) -> bool:
        if not block.pinned:
            return False
        block.pinned = False
        self.num_pinned -= 1
        self.free([block])
        return True
