"""Pins and retention: which cached prefixes an operator keeps, and how much of the GPU
pool they may hold.

A hard pin keeps a prefix's blocks for ever (one reference each); it is refused over the
pin budget (a share of the GPU pool) and when it would leave a request already here too
few unpinned blocks to ever run. A soft pin keeps its blocks over every block not soft
pinned, for a time to live, and takes nothing from a request. The pool does the pinning
(KVCacheCoordinator.pin, soft_pin); this module owns the budget and the checks.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.block_hash import hash_blocks, root_hash
from engine.config import EVICTION_POLICIES
from engine.errors import InvalidRequestError, NotEnoughBlocksError, PrefixNotCachedError
from engine.kv.block_pool import KVBlock
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.tenant_cache import check_share


class Pins:
    def __init__(self, kv: KVCacheCoordinator, model_id: str, budget: float) -> None:
        self.kv = kv
        self.model_id = model_id  # (prefix hashes are rooted in it)
        self.budget = budget  # the most of the GPU pool hard pins may hold, 0-1; owned here

    def prefix(self, token_ids: list[int], cache_salt: str | None) -> list[KVBlock]:
        """The cached blocks of this prefix's chain (at least one full block of it)."""
        bs = self.kv.block_size
        if len(token_ids) < bs:
            raise InvalidRequestError(
                f"a prefix needs at least one full block ({bs} tokens); got {len(token_ids)}")
        blocks = self.kv.cached_chain(hash_blocks(root_hash(self.model_id, cache_salt),
                                                  token_ids, bs))
        if not blocks:
            raise PrefixNotCachedError(
                "no block of this prefix is cached; run a request with it first")
        return blocks

    def pin(self, blocks: list[KVBlock], needs: Iterable[tuple[str, int]], soft: bool = False,
            priority: int = 0, ttl_s: float = 3600.0) -> dict:
        """Pin these blocks so they are never evicted. soft: keep them over every block
        not soft-pinned instead, for ttl_s (each hit renews it), by priority among soft
        pins (a lower value is kept longer): they are evicted when nothing else is left,
        so a soft pin takes nothing from a request. needs: each live request's id and
        the most GPU blocks it holds at once, which a hard pin must leave it."""
        if soft:
            if not ttl_s > 0:
                raise InvalidRequestError("a soft pin's ttl_s must be positive")
            newly = self.kv.soft_pin(blocks, priority, ttl_s)
            return {**self._answer(blocks, "num_newly_pinned", newly), "soft": True,
                    "priority": priority, "ttl_s": ttl_s}
        self._check_budget(blocks)
        self._check_leaves_room(blocks, needs)
        return self._answer(blocks, "num_newly_pinned", self.kv.pin(blocks))

    def unpin(self, blocks: list[KVBlock], soft: bool = False) -> dict:
        released = self.kv.soft_unpin(blocks) if soft else self.kv.unpin(blocks)
        return self._answer(blocks, "num_unpinned", released)

    def _answer(self, blocks: list[KVBlock], changed: str, which: list[KVBlock]) -> dict:
        """A pin's or unpin's answer: the prefix's blocks, how many changed (`changed`
        names the count), the tokens they hold."""
        return {"block_ids": [b.block_id for b in blocks], changed: len(which),
                "num_tokens": len(blocks) * self.kv.block_size}

    def usable_blocks(self, token_ids: list[int], cache_salt: str | None) -> int:
        """Blocks a request with this prompt could ever hold: the unpinned ones, plus the
        pinned blocks of its own cached prefix (it shares those)."""
        gpu = self.kv.gpu
        if not gpu.num_pinned:
            return gpu.num_blocks
        shared = 0
        for salt in {cache_salt, None}:  # a salted request shares pinned unsalted blocks
            hashes = hash_blocks(root_hash(self.model_id, salt), token_ids, self.kv.block_size)
            shared = max(shared, sum(b.pinned for b in self.kv.cached_chain(hashes)))
        return gpu.num_blocks - gpu.num_pinned + shared

    def _check_budget(self, blocks: list[KVBlock]) -> None:
        """NotEnoughBlocksError if, with these blocks pinned too, pins would hold more
        of the pool than the pin budget allows."""
        gpu = self.kv.gpu
        newly = sum(1 for b in blocks if not b.pinned)
        allowed = int(self.budget * gpu.num_blocks)
        if gpu.num_pinned + newly > allowed:
            raise NotEnoughBlocksError(
                f"pinning {newly} more blocks would make {gpu.num_pinned + newly} pinned, over "
                f"the pin budget of {allowed} blocks ({self.budget:.0%} of "
                f"{gpu.num_blocks}): unpin a prefix, or raise the budget")

    def _check_leaves_room(self, blocks: list[KVBlock],
                           needs: Iterable[tuple[str, int]]) -> None:
        """NotEnoughBlocksError if, with these blocks pinned too, a request already here
        could never hold all the blocks it needs (it would preempt itself for ever)."""
        gpu = self.kv.gpu
        pinned = {b.block_id for b in gpu.blocks if b.pinned} | {b.block_id for b in blocks}
        free_for_all = gpu.num_blocks - len(pinned)
        for request_id, need in needs:
            own = sum(b in pinned for b in self.kv.block_ids(request_id))
            if need > free_for_all + own:
                raise NotEnoughBlocksError(
                    f"pinning {len(blocks)} blocks would leave {free_for_all} unpinned blocks "
                    f"of {gpu.num_blocks}; request {request_id} needs {need}: "
                    "it could never run. Pin later, or a shorter prefix")

    def set_retention(self, pin_budget: float | None = None,
                      eviction_policy: str | None = None,
                      tenant_cache_quota: float | None = None) -> dict:
        """Change what the prefix cache keeps, live: the pin budget (a share of the GPU
        pool, 0-1; pins above a lowered budget stay, new ones are refused), the GPU
        pool's eviction policy (its free blocks ranked anew, in their order) and each
        tenant's quota of its cached blocks (engine/kv/tenant_cache.py; 1: none)."""
        if pin_budget is not None and (
                isinstance(pin_budget, bool) or not isinstance(pin_budget, (int, float))
                or not 0.0 <= pin_budget <= 1.0):
            raise InvalidRequestError("pin_budget must be a number in [0, 1]")
        if eviction_policy is not None and eviction_policy not in EVICTION_POLICIES:
            raise InvalidRequestError(f"eviction_policy must be one of "
                                      f"{', '.join(EVICTION_POLICIES)}")
        if tenant_cache_quota is not None:
            check_share(tenant_cache_quota, "tenant_cache_quota")
        if pin_budget is not None:
            self.budget = float(pin_budget)
        if tenant_cache_quota is not None:
            self.kv.gpu.tenants.set_share(tenant_cache_quota)
        if eviction_policy is not None:
            self.kv.gpu.set_eviction_policy(eviction_policy)
        return self.retention()

    def retention(self) -> dict:
        gpu = self.kv.gpu
        return {"pin_budget": self.budget,
                "pin_budget_blocks": int(self.budget * gpu.num_blocks),
                "num_pinned_blocks": gpu.num_pinned, "eviction_policy": gpu.eviction_policy,
                "tenant_cache_quota": gpu.tenants.share}
