"""Block tables per layer group, for models that mix sliding-window and global layers
(Gemma 2 and 3), as vLLM's hybrid KV-cache manager keeps them.

A global layer needs the K/V of every token; a sliding layer only of the last `window`.
With one block table for all layers, a block holds every layer's K/V and none can go
back while a global layer still reads it: the sliding layers' share of the pool (5/6 of
it for Gemma 3) is spent on tokens they never look at again.

So the layers are split into groups of the same size (KVLayout): every layer of a group
has the same window, and a block of the pool holds the K/V of one group's layers (the
cache has `slots` layers per block; layer i writes slot layer_slot[i] of its group's
blocks). Each group keeps its own block table per request, in one shared pool:

* group 0 is a global group: its table is the request's table everywhere (snapshots,
  the dashboard's block tables, pins, routing, vLLM-format events), its blocks cached
  under the request's prefix hashes;
* a sliding group's table gives back its leading blocks once the window has passed
  them (KVCacheManager's window free), and caches its blocks under hashes of its own
  (kv_cache_manager.group_hash), so a prefix hit finds each group's blocks for the same
  tokens;
* a prefix hit is the longest prefix for which the global groups hold every block and
  each sliding group the blocks the window of the first token to compute reaches
  (HybridKVCacheManager.find_prefix).

Not kept per group: the CPU tier of the prefix cache (a model with groups keeps one
table when it is on: LLMEngine), and swap-ins reuse cached blocks only in the groups
whose tables start at block 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock
from engine.events import EventLog
from engine.kv_cache_manager import (
    _NOTHING_ALLOCATED, Allocation, KVCacheManager, PrefixMatch, SwapResult, cdiv, group_hash,
)
from engine.request import Request


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where each layer's K/V lives in the cache."""
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None: global
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its place among its group's layers
    slots: int  # layers per block (the cache's first dimension)

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_layout(layer_windows: tuple[int, ...], n_layers: int, hybrid: bool = True) -> KVLayout:
    """The layout for layers with these sliding windows (0: global; empty: all global).

    One group, every layer in every block, unless the model mixes global layers with
    sliding ones of one window and `hybrid` is on: then groups of k layers, k the fewer
    of the two kinds, the global groups first (the last group of a kind may have fewer
    than k layers: its blocks leave the other slots unused)."""
    windows = tuple(layer_windows) or (0,) * n_layers
    sliding = sorted({w for w in windows if w})
    full = [i for i, w in enumerate(windows) if not w]
    if not hybrid or not full or len(sliding) != 1 or len(full) == n_layers:
        # every layer slides: blocks older than the widest window can go back
        window = max(windows) if windows and min(windows) > 0 else None
        return KVLayout((window,), (0,) * n_layers, tuple(range(n_layers)), n_layers)
    slides = [i for i, w in enumerate(windows) if w]
    k = min(len(full), len(slides))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * n_layers, [0] * n_layers
    for layers, window in ((full, None), (slides, sliding[0])):
        for start in range(0, len(layers), k):
            for slot, layer in enumerate(layers[start:start + k]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), k)


@dataclass(slots=True)
class HybridMatch:
    """Cached blocks found for a request about to be admitted: one match per group."""
    groups: list[PrefixMatch]

    @property
    def num_computed_tokens(self) -> int:
        return self.groups[0].num_computed_tokens


class HybridKVCacheManager:
    """KVCacheManager's interface over one KVCacheManager per layer group, all in one GPU
    pool and one CPU pool. An allocation, swap or free is all groups' or none's."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 enable_caching: bool, events: EventLog,
                 group_windows: tuple[int | None, ...]) -> None:
        if group_windows[0] is not None:
            raise ValueError("a hybrid layout's group 0 is a global group")
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, enable_caching, events, "gpu")
        self.cpu = BlockPool(num_cpu_blocks, False, events, "cpu")
        pools = (self.gpu, self.cpu)
        self.groups = [KVCacheManager(block_size, 0, 0, enable_caching, events,
                                      sliding_window=w, pools=pools, group=g)
                       for g, w in enumerate(group_windows)]
        self.main = self.groups[0]
        self.sliding_window = None  # (not every layer slides)
        self.cpu_tier = False
        self.cpu_prefix_cache_hits = 0
        self.num_blocks_offloaded = self.num_blocks_onloaded = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # The request's table everywhere one table is shown is group 0's.
    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:
        return self.main.req_to_blocks

    @property
    def req_to_cpu_blocks(self) -> dict[str, list[KVBlock]]:
        return self.main.req_to_cpu_blocks

    @property
    def prefix_cache_queries(self) -> int:
        return self.main.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.main.prefix_cache_hits

    @property
    def window_freed_counts(self) -> dict[str, int]:
        return self.main.window_freed_counts

    def window_freed(self, request_id: str) -> int:
        return 0  # (group 0's table keeps every block)

    def group_tables(self, pool: str = "gpu") -> list[tuple[int, dict[str, list[KVBlock]]]]:
        """(group, its tables by request id) of the groups other than 0: their blocks
        are the requests' too (owners, reference counts)."""
        return [(g.group, g.req_to_blocks if pool == "gpu" else g.req_to_cpu_blocks)
                for g in self.groups[1:]]

    # --- admission -------------------------------------------------------------------
    def find_prefix(self, request: Request) -> HybridMatch:
        """The longest prefix every group can serve: group 0's hit, shortened until each
        sliding group holds the blocks its window reaches from the first token to
        compute, and each other global group every block."""
        first = self.main.find_prefix(request)
        nothing = HybridMatch([PrefixMatch([], 0, False) for _ in self.groups])
        if not first.blocks:
            return nothing
        bs, n = self.block_size, len(first.blocks)
        # Per other group: its cached block at each index below n, or None; keyed by the
        # hashes of group 0's blocks (the request's, or a pinned prefix's unsalted chain)
        matched = [b.block_hash for b in first.blocks]
        cached = [[g.gpu.get_cached(group_hash(h, g.group)) for h in matched]
                  for g in self.groups[1:]]
        for length in range(n, 0, -1):
            num_computed = min(length * bs, request.num_tokens - 1)
            cow = length * bs > num_computed
            found = self._groups_at(cached, length, num_computed, cow)
            if found is not None:
                matches = [PrefixMatch(first.blocks[:length], num_computed, cow)] + found
                break
        else:
            return nothing
        if cow and any(m.blocks and m.blocks[-1].block_id in g.uncomputed
                       for g, m in zip(self.groups, matches)):
            # a copy of data the coming step writes: the last block is recomputed instead
            length -= 1
            num_computed = length * bs
            found = self._groups_at(cached, length, num_computed, False) if length else None
            if found is None:
                return nothing
            matches = [PrefixMatch(first.blocks[:length], num_computed, False)] + found
        return HybridMatch(matches)

    def _groups_at(self, cached: list[list[KVBlock | None]], length: int, num_computed: int,
                   cow: bool) -> list[PrefixMatch] | None:
        """The other groups' matches for a hit of `length` blocks, or None if one lacks a
        block it needs."""
        out = []
        for group, blocks in zip(self.groups[1:], cached):
            skip = self._window_start(group, num_computed, length)
            needed = blocks[skip:length]
            if any(b is None for b in needed):
                return None
            out.append(PrefixMatch(list(needed), num_computed, cow, skip=skip))
        return out

    def _window_start(self, group: KVCacheManager, num_computed: int, length: int) -> int:
        """The first of a prefix's `length` blocks that group `group` needs for the token
        at position num_computed: 0 for a global group; for a sliding one the block of
        position num_computed - window + 1, the furthest back it sees (the prefix's last
        block at most)."""
        window = group.sliding_window
        if window is None:
            return 0
        return min(max(num_computed - window + 1, 0) // self.block_size, length - 1)

    def record_prefix_query(self, request: Request, match: HybridMatch) -> None:
        self.main.record_prefix_query(request, match.groups[0])

    # --- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       match: HybridMatch | None = None) -> Allocation | None:
        matches = match.groups if match is not None else [None] * len(self.groups)
        need = sum(g.blocks_needed(request, num_new_tokens, m)
                   for g, m in zip(self.groups, matches))
        if need > self.gpu.num_free:
            return None
        # Every group's reused blocks are held before any group takes new ones (which
        # could otherwise reuse a free cached block another group is about to revive).
        held = [b for m in matches if m is not None
                for b in (m.blocks[:-1] if m.cow else m.blocks)]
        self.gpu.touch(held)
        allocations = [g.allocate_slots(request, num_new_tokens, m)
                       for g, m in zip(self.groups, matches)]
        self.gpu.free(held)
        if any(a is None for a in allocations):
            raise RuntimeError(f"invariant: a layer group of {request.request_id} "
                               "found no room after the room was counted")
        if all(a is _NOTHING_ALLOCATED for a in allocations):
            return _NOTHING_ALLOCATED
        return Allocation(new_blocks=[b for a in allocations for b in a.new_blocks],
                          copies=[c for a in allocations for c in a.copies])

    def fork(self, parent: Request, child: Request) -> None:
        for g in self.groups:
            g.fork(parent, child)

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    def flush_offloads(self) -> list[tuple[int, int]]:
        return [m for g in self.groups for m in g.flush_offloads()]

    def copy_ahead(self, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        return []

    def mark_computed(self) -> None:
        for g in self.groups:
            g.mark_computed()

    def forget_uncomputed(self) -> int:
        return sum(g.forget_uncomputed() for g in self.groups)

    # --- swap --------------------------------------------------------------------------
    def swap_out(self, request: Request) -> SwapResult | None:
        rid = request.request_id
        need = sum(len(g.req_to_blocks.get(rid, ())) for g in self.groups)
        if need > self.cpu.num_free:
            return None
        results = [g.swap_out(request) for g in self.groups]
        return SwapResult([m for r in results for m in r.mapping])

    def swap_in(self, request: Request) -> SwapResult | None:
        rid = request.request_id
        need = sum(len(g.req_to_cpu_blocks.get(rid, ())) for g in self.groups)
        if need > self.gpu.num_free:  # (hits only lower it)
            return None
        results = [g.swap_in(request) for g in self.groups]
        return SwapResult([m for r in results for m in r.mapping],
                          num_hit_blocks=results[0].num_hit_blocks)

    # --- operator: evict, reset, pin (the pool's, or group 0's prefix) -------------------
    def evict(self, n: int | None) -> int:
        return self.main.evict(n)

    def reset_prefix_cache(self) -> dict:
        return self.main.reset_prefix_cache()

    def cached_chain(self, hashes: list) -> list[KVBlock]:
        return self.main.cached_chain(hashes)

    def pin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Pin a cached prefix (group 0's blocks, from block 0): the other groups'
        blocks a hit on it needs are pinned too. Returns group 0's newly pinned."""
        for g in self.groups[1:]:
            g.pin(self._same_tokens(g, blocks))
        return self.main.pin(blocks)

    def unpin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        for g in self.groups[1:]:
            g.unpin(self._same_tokens(g, blocks))
        return self.main.unpin(blocks)

    def _same_tokens(self, group: KVCacheManager, blocks: list[KVBlock]) -> list[KVBlock]:
        """Group `group`'s cached blocks for the tokens of group 0's prefix `blocks`: all
        of them, or for a sliding group those the window reaches from the prefix's end
        (what a prompt that continues it reads)."""
        skip = self._window_start(group, len(blocks) * self.block_size, len(blocks))
        found = (group.gpu.get_cached(group_hash(b.block_hash, group.group))
                 for b in blocks[skip:])
        return [b for b in found if b is not None]

    # --- introspection ---------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's table: the request's table wherever one is shown."""
        return self.main.block_ids(request_id)

    def cpu_block_ids(self, request_id: str) -> list[int]:
        return self.main.cpu_block_ids(request_id)

    def num_blocks_held(self, request_id: str) -> int:
        """GPU blocks the request holds, in every group's table."""
        return sum(g.num_blocks_held(request_id) for g in self.groups)

    def num_cpu_blocks_held(self, request_id: str) -> int:
        return sum(g.num_cpu_blocks_held(request_id) for g in self.groups)

    def step_block_ids(self, request_id: str) -> list[int]:
        return self.main.step_block_ids(request_id)

    def group_step_block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's table for this step's batch (-1 where a window gave a block back)."""
        return [g.step_block_ids(request_id) for g in self.groups]

    def check_invariants(self) -> None:
        """KVCacheManager.check_invariants over the union of every group's tables."""
        merged = KVCacheManager.__new__(KVCacheManager)
        merged.gpu, merged.cpu = self.gpu, self.cpu
        merged._cpu_held = [b for g in self.groups for b in g._cpu_held]
        merged.req_to_blocks = {(g.group, rid): t for g in self.groups
                                for rid, t in g.req_to_blocks.items()}
        merged.req_to_cpu_blocks = {(g.group, rid): t for g in self.groups
                                    for rid, t in g.req_to_cpu_blocks.items()}
        KVCacheManager.check_invariants(merged)
        for g in self.groups:
            for rid, table in g.req_to_blocks.items():
                if rid not in self.main.req_to_blocks:
                    raise AssertionError(f"invariant: group {g.group} holds blocks for {rid}, "
                                         "group 0 none")
                held = len(table) + g.window_freed(rid)
                if held != len(self.main.req_to_blocks[rid]):
                    raise AssertionError(
                        f"invariant: group {g.group}'s table of {rid} covers {held} blocks, "
                        f"group 0's {len(self.main.req_to_blocks[rid])}")


def blocks_for(num_tokens: int, block_size: int, windows: tuple[int | None, ...],
               chunk: int = 0) -> int:
    """Blocks a request of num_tokens holds at most, with a table per window (None:
    global): a global table every block, a sliding one those the window and a step's
    chunk of `chunk` tokens reach, plus one."""
    n = cdiv(num_tokens, block_size)
    return sum(n if w is None else min(n, cdiv(w + chunk, block_size) + 1) for w in windows)
