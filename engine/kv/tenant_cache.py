"""Tenants' share of the GPU prefix cache: whose cached blocks these are, and a quota
that keeps one tenant's flood from evicting another's prefix.

A cached block belongs to the tenant whose request computed it (KVBlock.tenant, set
when the block enters the hash map; a request without a tenant, staff's, caches blocks
of nobody's). A tenant's count is its blocks in the hash map, held by running requests or
free; its quota (a share of the GPU pool, EngineConfig.tenant_cache_quota, or a per-tenant
override) bounds that count. When the pool must take a cached block, it takes the least
recently freed free block of the tenant furthest over its quota before the eviction
policy's choice: blocks of a tenant under its quota are taken only when no tenant over
its quota has a free cached block left. Blocks a running request holds are never taken
by an eviction, and neither are soft-pinned ones.

BlockPool calls the hooks below at each change of a block's hash or of its freedom; this
module owns the counts and the limits and never moves a block itself.

An admission takes no free cached block of a tenant under its quota beyond the room its
own tenant has left under its quota (BlockPool.room_for counts them out, take_new passes
over them): it waits for room instead, so that a flood of one tenant's prompts, once its
running requests hold the pool, does not reach into another tenant's prefix. Nor does
its running requests' growth: when a running request's next blocks would take them, its
own tenant's newest running requests give way (the scheduler's _within_quota), except its
oldest, which takes them (every tenant progresses; a request larger than its tenant's
quota still ends); and a swapped request of a tenant with requests running is swapped
back in only within its quota. Within one allocation, a tenant that falls back under its
quota as its blocks are taken is passed over only from then on.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.kv.block_pool import KVBlock


def check_share(value, name: str) -> float:
    """A quota's share of the pool, in (0, 1] (1: no quota); InvalidRequestError else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise InvalidRequestError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


class TenantCache:
    def __init__(self, num_blocks: int, share: float = 1.0) -> None:
        self.num_blocks = num_blocks
        self.share = share  # every tenant's quota, of num_blocks (1.0: none)
        self.overrides: dict[str, float] = {}  # a tenant's own quota, set by an operator
        self.counts: Counter[str] = Counter()  # blocks in the hash map, per tenant
        # Free cached blocks per tenant, least recently freed first (dicts keep order)
        self.free: dict[str, dict[KVBlock, None]] = {}
        self.num_taken = 0  # cached blocks the quota chose to evict (over the policy's)

    # --- limits ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.share < 1.0 or any(s < 1.0 for s in self.overrides.values())

    def limit(self, tenant: str) -> int:
        """The most blocks this tenant's cache may hold before its blocks go first."""
        return int(self.overrides.get(tenant, self.share) * self.num_blocks)

    def limits_of(self, tenant: str) -> dict:
        """One tenant's quota (its share and in blocks, whether its own) and its cached
        blocks now."""
        return {"cache_quota": self.overrides.get(tenant, self.share),
                "cache_quota_blocks": self.limit(tenant),
                "own_cache_quota": tenant in self.overrides,
                "cached_blocks": self.counts.get(tenant, 0)}

    def set_share(self, share: float) -> None:
        self.share = check_share(share, "tenant_cache_quota")

    def set_override(self, tenant: str, share: float | None) -> None:
        """A tenant's own quota (None: back to everyone's)."""
        if share is None:
            self.overrides.pop(tenant, None)
        else:
            self.overrides[tenant] = check_share(share, "cache_quota")

    # --- hooks (BlockPool) ---------------------------------------------------------------
    def cached(self, block: KVBlock) -> None:
        """The block entered the hash map as its tenant's."""
        self.counts[block.tenant] += 1
        if block.ref_cnt == 0:
            self.free.setdefault(block.tenant, {})[block] = None

    def uncached(self, block: KVBlock) -> None:
        """The block's hash left the map (evicted, forgotten, reset)."""
        tenant = block.tenant
        self.counts[tenant] -= 1
        if not self.counts[tenant]:
            del self.counts[tenant]
        free = self.free.get(tenant)
        if free is not None and block in free:
            del free[block]
            if not free:
                del self.free[tenant]

    def freed(self, block: KVBlock) -> None:
        """Its last holder let the cached block go: the newest of its tenant's free ones."""
        self.free.setdefault(block.tenant, {})[block] = None

    def taken(self, block: KVBlock) -> None:
        """A free cached block is held again (a prefix hit)."""
        free = self.free[block.tenant]
        del free[block]
        if not free:
            del self.free[block.tenant]

    def refreshed(self, block: KVBlock) -> None:
        """A free cached block became its tenant's most recently used."""
        free = self.free[block.tenant]
        del free[block]
        free[block] = None

    # --- eviction --------------------------------------------------------------------------
    def victim(self, now: float) -> KVBlock | None:
        """The free cached block the quota takes next: the least recently freed one, not
        soft-pinned, of the tenant furthest over its quota; None if no tenant over its
        quota has one."""
        best, best_over = None, 0
        for tenant, free in self.free.items():
            over = self.counts[tenant] - self.limit(tenant)
            if over <= best_over:
                continue
            for block in free:
                if not block.soft_until or block.soft_until <= now:
                    best, best_over = block, over
                    break
        return best

    def headroom(self, tenant: str) -> int:
        """The blocks this tenant may still cache before it is over its quota (< 0: over)."""
        return self.limit(tenant) - self.counts.get(tenant, 0)

    def protected_from(self, tenant: str | None) -> int:
        """Free cached blocks an admission of `tenant` may not take: those of every other
        tenant under its quota, less the room `tenant` has left under its own (so that
        an admission never takes it past its quota at another's expense)."""
        if tenant is None:
            return 0
        headroom = self.headroom(tenant)
        protected = sum(len(free) for t, free in self.free.items()
                        if t != tenant and self.counts[t] <= self.limit(t))
        return max(0, protected - max(0, headroom))

    def takeable_by(self, block: KVBlock, tenant: str) -> bool:
        """Whether an admission of an over-quota `tenant` may take this free block."""
        owner = block.tenant
        return owner is None or owner == tenant or self.counts[owner] > self.limit(owner)

    def check(self, blocks: list[KVBlock]) -> None:
        """Invariant: the counts and free lists are the pool's blocks recounted."""
        counts: Counter[str] = Counter()
        free: Counter[str] = Counter()
        for block in blocks:
            if block.block_hash is not None and block.tenant is not None:
                counts[block.tenant] += 1
                if block.ref_cnt == 0:
                    free[block.tenant] += 1
            elif block.tenant is not None:
                raise AssertionError(f"invariant: uncached block {block.block_id} has a tenant")
        if counts != self.counts:
            raise AssertionError(f"invariant: tenants' cached blocks {dict(self.counts)}, "
                               f"recounted {dict(counts)}")
        listed = Counter({t: len(f) for t, f in self.free.items()})
        if listed != free:
            raise AssertionError(f"invariant: tenants' free cached blocks {dict(listed)}, "
                               f"recounted {dict(free)}")
