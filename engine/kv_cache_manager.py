"""Per-request block tables on the GPU pool and the CPU swap pool.

KVCacheManager answers "can this request get slots for n more tokens?" with blocks or
None. It never chooses a victim: the Scheduler does. It owns the block tables and the
prefix-cache bookkeeping (which of a request's blocks were offered to the cache, and
the hit/query counters).

Sliding windows: when every layer of the model attends only to the last `window`
tokens, a request's leading blocks that no future token can see go back to the pool
(cached ones stay findable by the prefix cache until reused). Its table then holds
only the blocks from the first still visible one on: `req_to_blocks` lists live
blocks, `_window_freed` counts the freed ones before them, and the ids the runner gets
(step_block_ids) put -1 in their places, so that table position = token // block_size.
With global layers too (Gemma) every block stays: they see the whole context.

CPU tier (cpu_prefix_cache): the CPU pool is also a second-level prefix cache, as
vLLM's KV offloading and SGLang's HiCache are. When the GPU pool is about to reuse a
cached block, its (block, hash) is noted; at the end of the schedule (flush_offloads)
each gets a free CPU block, registered under the hash, and the copy GPU -> CPU joins
the step's swap-outs, which run before anything writes the GPU block. A prefix that
misses on the GPU continues on the CPU pool: those blocks get new GPU blocks and are
copied in with the step's swap-ins. Swapped requests come first: their swap-out takes
CPU blocks like any other, evicting cached ones. CPU blocks that a step's copies read
(swap-ins, tier hits) are held until the flush, so no copy of the same step
overwrites them.
"""
from __future__ import annotations

import functools
import hashlib
from collections import Counter
from dataclasses import dataclass, field

from engine.block_hash import BlockHash, hash_blocks, short
from engine.block_pool import BlockPool, KVBlock
from engine.events import EventLog
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The cache key of a block of layer group `group` (> 0) holding the tokens that
    block_hash names."""
    return hashlib.sha256(b"kvops-group\0" + bytes([group]) + block_hash).digest()


@dataclass(slots=True)
class PrefixMatch:
    """Cached blocks found for a request about to be admitted."""
    blocks: list[KVBlock]  # leading cached blocks, in table order
    num_computed_tokens: int  # tokens they cover, capped so the last token is computed
    cow: bool  # the last matched block will be written (copy it first)
    # The CPU tier's blocks that continue `blocks` (copied into new GPU blocks)
    cpu_blocks: list[KVBlock] = field(default_factory=list)
    # Leading table places not held: blocks a sliding window no longer reaches (a
    # hybrid model's sliding layer group); `blocks` come after them
    skip: int = 0


@dataclass(slots=True)
class Allocation:
    """What allocate_slots did, for the model runner."""
    new_blocks: list[KVBlock] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    copies_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu) tier hits


_NOTHING_ALLOCATED = Allocation()  # the decode fast path's answer (never modified)


@dataclass(slots=True)
class SwapResult:
    mapping: list[tuple[int, int]]  # (src block, dst block) to copy, src pool -> dst pool
    num_hit_blocks: int = 0  # swap-in only: blocks found in the prefix cache, not copied


class KVCacheManager:
    num_groups = 1  # layer groups with a table of their own (HybridKVCacheManager: more)

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 enable_caching: bool, events: EventLog, sliding_window: int | None = None,
                 cpu_prefix_cache: bool = False,
                 pools: tuple[BlockPool, BlockPool] | None = None, group: int = 0) -> None:
        """pools and group: one layer group of a hybrid model (engine/hybrid_kv.py), its
        tables in pools shared with the other groups. A group other than 0 caches its
        blocks under hashes of its own (group_hash) and tells no external router."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # every layer's window, or None
        self.group = group
        self._emit = functools.partial(events.emit, group=group) if group else events.emit
        self._window_freed: dict[str, int] = {}  # leading blocks a request gave back
        if pools is None:
            self.gpu = BlockPool(num_gpu_blocks, enable_caching, events, "gpu")
            self.cpu_tier = cpu_prefix_cache and enable_caching and num_cpu_blocks > 0
            self.cpu = BlockPool(num_cpu_blocks, self.cpu_tier, events, "cpu")
        else:
            self.gpu, self.cpu = pools
            self.cpu_tier = False
        if group == 0:
            self.gpu.on_evict = self._gpu_evicted
            self.cpu.on_evict = self._cpu_evicted
        self._to_offload: list[tuple[int, BlockHash]] = []  # GPU blocks reused this schedule
        self._cpu_held: list[KVBlock] = []  # CPU blocks this step's copies read
        self.cpu_uncomputed: list[KVBlock] = []  # CPU blocks this step's offloads fill
        self.cpu_prefix_cache_hits = 0  # prompt tokens found on the CPU tier (tokens)
        self.num_blocks_offloaded = 0  # tier copies GPU -> CPU
        self.num_blocks_onloaded = 0  # tier copies CPU -> GPU
        # With external events: the parent hash and token ids of each cached hash, for
        # the CPU tier's BlockStored (its blocks arrive by hash alone)
        self._hash_tokens: dict[BlockHash, tuple[BlockHash | None, list[int]]] = {}
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # GPU block table
        self._step_ids: dict[str, tuple[list, list[int]]] = {}  # step_block_ids cache
        self.req_to_cpu_blocks: dict[str, list[KVBlock]] = {}  # CPU table while swapped
        self._num_offered: dict[str, int] = {}  # leading blocks already offered to the cache
        # Samples of a fork whose partly filled last block may still be shared: the first
        # write into it copies it (allocate_slots).
        self._shared_tail: set[str] = set()
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0  # of which found cached (tokens)
        # Blocks registered in the cache during this schedule, whose K/V the coming
        # forward pass writes. A same-step hit may read them (each layer writes all K/V
        # before attending) but not copy them: copies run before the forward pass.
        self.uncomputed: set[int] = set()
        self._events = events

    # --- admission -------------------------------------------------------------------
    def find_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of cached blocks for the request's tokens (not yet referenced)."""
        if not self.enable_caching or (request.sampling_params.prompt_logprobs is not None
                                       and len(request.prompt_logprobs) < request.num_prompt_tokens):
            return PrefixMatch([], 0, False)  # (its prompt's logprobs need every position)
        blocks = []
        for block_hash in request.block_hashes:
            block = self.gpu.get_cached(block_hash)
            if block is None:
                break
            blocks.append(block)
        if request.pinned_root is not None and self.gpu.num_pinned:
            shared = self._pinned_prefix(request)
            if len(shared) > len(blocks):
                blocks = shared  # its own later blocks are still cached under its salt
        cpu_blocks: list[KVBlock] = []
        if self.cpu_tier and self.cpu.cached:
            for block_hash in request.block_hashes[len(blocks):]:
                block = self.cpu.get_cached(block_hash)
                if block is None:
                    break
                cpu_blocks.append(block)
        covered = (len(blocks) + len(cpu_blocks)) * self.block_size
        if covered >= request.num_tokens and cpu_blocks:
            cpu_blocks.pop()  # the last token's block is computed, not copied in
            covered -= self.block_size
        elif covered >= request.num_tokens and blocks[-1].block_id in self.uncomputed:
            blocks.pop()  # it would need a copy of data not written yet: recompute it
            covered -= self.block_size
        # A hit always leaves the last token to compute (its logits are needed). When the
        # hit covers every token, that token is rewritten in a copy of the last block.
        num_computed = min(covered, request.num_tokens - 1)
        return PrefixMatch(blocks, num_computed, cow=covered > num_computed,
                           cpu_blocks=cpu_blocks)

    def hashes(self, request: Request, start: int, end: int) -> list[BlockHash]:
        """The cache keys of the request's full blocks [start, end) in this group: its
        block hashes, or for another layer group than 0 a hash of each with the group's
        number (the same tokens' K/V of other layers)."""
        hashes = request.block_hashes[start:end]
        return [group_hash(h, self.group) for h in hashes] if self.group else hashes

    def _pinned_prefix(self, request: Request) -> list[KVBlock]:
        """The leading pinned blocks of the request's tokens in the unsalted chain."""
        out = []
        for block_hash in hash_blocks(request.pinned_root, request.all_token_ids,
                                      self.block_size):
            block = self.gpu.get_cached(block_hash)
            if block is None or not block.pinned:
                break
            out.append(block)
        return out

    def record_prefix_query(self, request: Request, match: PrefixMatch) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += match.num_computed_tokens
        if match.blocks:
            self._emit("PrefixHit", request_id=request.request_id,
                       block_ids=[b.block_id for b in match.blocks],
                       block_hashes=[short(b.block_hash) for b in match.blocks],
                       ref_cnts=[b.ref_cnt for b in match.blocks],
                       num_tokens=len(match.blocks) * self.block_size
                       if match.cpu_blocks else match.num_computed_tokens)
        if match.cpu_blocks:
            num_cpu_tokens = len(match.cpu_blocks) * self.block_size
            self.cpu_prefix_cache_hits += num_cpu_tokens
            self._emit("PrefixHit", request_id=request.request_id, pool="cpu",
                       block_ids=[b.block_id for b in match.cpu_blocks],
                       block_hashes=[short(b.block_hash) for b in match.cpu_blocks],
                       ref_cnts=[b.ref_cnt for b in match.cpu_blocks],
                       num_tokens=num_cpu_tokens,
                       detail="CPU tier: copied into GPU blocks, not recomputed")

    # --- allocation ------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       match: PrefixMatch | None = None) -> Allocation | None:
        """Give the request room for num_new_tokens more tokens after its computed ones.

        On admission, `match` (from find_prefix) holds the cached blocks to reuse and
        request.num_computed_tokens must already count them. Returns None, changing
        nothing, when the GPU pool has too few free blocks.
        """
        rid = request.request_id
        if self.sliding_window is not None and match is None and rid in self.req_to_blocks:
            self._free_out_of_window(request)
        if rid in self._shared_tail:
            return self._allocate_unshared(request, num_new_tokens)
        table = self.req_to_blocks.get(rid, [])
        if match is not None and match.skip and not table:
            self._window_freed[rid] = match.skip  # (places before the window: not held)
        freed = self._window_freed.get(rid, 0) if self._window_freed else 0
        total_tokens = request.num_computed_tokens + num_new_tokens
        if match is None and table and cdiv(total_tokens, self.block_size) <= len(table) + freed:
            # Decode fast path: the last block still has room.
            if total_tokens // self.block_size > self._num_offered[rid]:
                self._offer_to_cache(request, total_tokens)
            return _NOTHING_ALLOCATED
        reuse: list[KVBlock] = []
        cow_src: KVBlock | None = None
        tier_hits = match.cpu_blocks if match is not None else ()
        if match is not None and (match.blocks or tier_hits):
            if table:
                raise RuntimeError(f"invariant: prefix match for {rid}, which holds blocks")
            reuse = list(match.blocks)
            if match.cow:
                cow_src = reuse.pop()
        num_new_blocks = cdiv(total_tokens, self.block_size) - len(table) - freed - len(reuse)
        num_revived = sum(1 for b in reuse if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.gpu.num_free:
            return None

        self.gpu.touch(reuse)
        new_blocks = self.gpu.take_new(max(num_new_blocks, 0))
        table = self.req_to_blocks.setdefault(rid, table)
        table.extend(reuse)
        table.extend(new_blocks)
        if rid not in self._num_offered:
            self._num_offered[rid] = freed + len(reuse)
        result = Allocation(new_blocks=new_blocks)
        if cow_src is not None and cow_src is not new_blocks[0]:
            result.copies.append((cow_src.block_id, new_blocks[0].block_id))
        if tier_hits:  # the first new blocks take the CPU tier's data
            self.cpu.touch(tier_hits)
            self._cpu_held.extend(tier_hits)
            result.copies_in = [(c.block_id, g.block_id) for c, g in zip(tier_hits, new_blocks)]
            self.num_blocks_onloaded += len(tier_hits)
        self._offer_to_cache(request, total_tokens)
        return result

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      match: PrefixMatch | None = None) -> int:
        """The free blocks allocate_slots(request, num_new_tokens, match) would take now
        (new ones, and cached ones it revives), after giving back the blocks out of the
        window as it does. For a hybrid model, which asks every group first."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if self.sliding_window is not None and match is None and table:
            self._free_out_of_window(request)
            table = self.req_to_blocks[rid]
        table = table or []
        total_tokens = request.num_computed_tokens + num_new_tokens
        freed = (match.skip if match is not None and match.skip and not table
                 else self._window_freed.get(rid, 0))
        num_new = cdiv(total_tokens, self.block_size) - len(table) - freed
        if rid in self._shared_tail and table[-1].ref_cnt > 1:
            return 1 + max(num_new, 0)  # (a copy of the shared last block)
        reuse = match.blocks[:-1] if match is not None and match.cow else \
            (match.blocks if match is not None else ())
        return max(num_new - len(reuse), 0) + sum(1 for b in reuse if b.ref_cnt == 0)

    def _free_out_of_window(self, request: Request) -> None:
        """Give back the request's leading blocks that its next token (at position
        num_computed_tokens) and every later one cannot see: those ending at or before
        position num_computed_tokens - window. The last block is always kept."""
        rid = request.request_id
        freed = self._window_freed.get(rid, 0)
        table = self.req_to_blocks[rid]
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        n = min(first_visible // self.block_size - freed, len(table) - 1)
        if n <= 0:
            return
        gone, self.req_to_blocks[rid] = table[:n], table[n:]  # a new list: mirrors rebuild
        self._window_freed[rid] = freed + n
        self._step_ids.pop(rid, None)
        self.gpu.free(reversed(gone))
        self._emit("WindowFreed", request_id=rid, block_ids=[b.block_id for b in gone],
                   ref_cnts=[b.ref_cnt for b in gone],
                   num_tokens=(freed + n) * self.block_size,
                   detail=f"out of the {self.sliding_window}-token window")

    def window_freed(self, request_id: str) -> int:
        """Leading blocks the request gave back because no layer's window reaches them."""
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
        if parent.request_id in self._window_freed:
            self._window_freed[child.request_id] = self._window_freed[parent.request_id]
        self._num_offered[child.request_id] = self._num_offered.get(parent.request_id, 0)
        if parent.num_computed_tokens % self.block_size:
            self._shared_tail.add(child.request_id)

    def _allocate_unshared(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """allocate_slots for a sample whose last block may be shared: if a sibling still
        holds it, this request writes into a copy (copy-on-write); the last holder keeps
        the original. None, changing nothing, when the pool is short."""
        rid = request.request_id
        table = self.req_to_blocks[rid]
        shared = table[-1]
        if shared.ref_cnt == 1:  # the others copied it or left: it is this request's alone
            self._shared_tail.discard(rid)
            return self.allocate_slots(request, num_new_tokens)
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = max(cdiv(total_tokens, self.block_size) - len(table)
                             - self._window_freed.get(rid, 0), 0)
        if 1 + num_new_blocks > self.gpu.num_free:
            return None
        copy, *grown = self.gpu.take_new(1 + num_new_blocks)
        self.gpu.free([shared])  # this request's reference (a sibling still holds it)
        # a new list: a viewer that kept the old one (kv_view) sees a table replaced, not
        # one that only grew
        self.req_to_blocks[rid] = table = table[:-1] + [copy] + grown
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
        hashes = self.hashes(request, start, end)
        group = self.group
        for i in range(start, end):
            block = table[i - freed]
            if self.gpu.cache(block, hashes[i - start]):
                block.group = group
                stored.append(block)
                indices.append(i)
                self.uncomputed.add(block.block_id)
        self._num_offered[rid] = max(start, end)
        if stored and self._events.external is not None and not self.group:
            self._external_stored(request, indices)
        if stored:
            self._emit("BlockStored", request_id=rid,
                       block_ids=[b.block_id for b in stored],
                       block_hashes=[short(b.block_hash) for b in stored],
                       ref_cnts=[b.ref_cnt for b in stored],
                       num_tokens=end * self.block_size)

    def _external_stored(self, request: Request, indices: list[int]) -> None:
        """vLLM-style BlockStored records: one per run of consecutive block indices."""
        bs, hashes = self.block_size, request.block_hashes
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        tokens = request.all_token_ids
        for run in runs:
            first, last = run[0], run[-1]
            self._events.external.append((
                "stored", [hashes[i] for i in run], hashes[first - 1] if first else None,
                list(tokens[first * bs:(last + 1) * bs])))
            if self.cpu_tier:
                for i in run:
                    self._hash_tokens[hashes[i]] = (hashes[i - 1] if i else None,
                                                    list(tokens[i * bs:(i + 1) * bs]))

    def free(self, request: Request) -> None:
        """Release the request's GPU blocks, last block first (so a chain's tail is
        evicted before its head), and any CPU blocks it holds."""
        rid = request.request_id
        self._num_offered.pop(rid, None)
        self._window_freed.pop(rid, None)
        self._shared_tail.discard(rid)
        table = self.req_to_blocks.pop(rid, [])
        self._step_ids.pop(rid, None)
        if table:
            self.gpu.free(reversed(table))
            self._emit("BlockRemoved", request_id=rid,
                       block_ids=[b.block_id for b in table],
                       ref_cnts=[b.ref_cnt for b in table])
        cpu_table = self.req_to_cpu_blocks.pop(rid, [])
        if cpu_table:
            self.cpu.free(reversed(cpu_table))
            self._emit("BlockRemoved", request_id=rid, pool="cpu",
                       block_ids=[b.block_id for b in cpu_table],
                       ref_cnts=[b.ref_cnt for b in cpu_table])

    # --- CPU tier ----------------------------------------------------------------------
    def _gpu_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """BlockPool.take_new is reusing these cached GPU blocks: with the CPU tier, note
        the ones whose data is written (not this step's) for flush_offloads."""
        if self._events.external is not None:
            self._external_removed(evicted)
        if self.cpu_tier:
            uncomputed = self.uncomputed
            self._to_offload.extend(e for e in evicted if e[0] not in uncomputed)
            self._forget_tokens([h for b, h in evicted if b in uncomputed])

    def _external_removed(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """vLLM-style BlockRemoved for GPU hashes that left the cache: group 0's (a
        hybrid model's other layer groups cache under hashes no router knows)."""
        blocks = self.gpu.blocks
        hashes = [h for b, h in evicted if not blocks[b].group]
        if hashes:
            self._events.external.append(("removed", hashes))

    def _cpu_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        hashes = [h for _, h in evicted]
        if self._events.external is not None:
            self._events.external.append(("removed", hashes, "CPU"))
        self._forget_tokens(hashes)

    def _forget_tokens(self, hashes: list[BlockHash]) -> None:
        """Drop the token records of hashes that no pool holds any more."""
        if self._hash_tokens:
            for h in hashes:
                if h not in self.gpu.cached and h not in self.cpu.cached:
                    self._hash_tokens.pop(h, None)

    def flush_offloads(self) -> list[tuple[int, int]]:
        """End of a schedule (or of an operator's command that took GPU blocks): give each
        GPU block noted by _gpu_evicted a CPU block under its hash, and release the CPU
        blocks this step's copies read. Returns the (gpu, cpu) copies, which must run
        before anything writes those GPU blocks (the step's swap-outs do)."""
        mapping: list[tuple[int, int]] = []
        if self._to_offload:
            stored: list[KVBlock] = []
            cpu = self.cpu
            for gpu_id, block_hash in self._to_offload:
                held = cpu.get_cached(block_hash)
                if held is not None:  # the tier has it already: it was used again
                    cpu.refresh(held)
                    continue
                if not cpu.num_free:  # every CPU block holds a swapped request
                    self._forget_tokens([block_hash])
                    continue
                block = self._tier_block(block_hash)
                stored.append(block)
                mapping.append((gpu_id, block.block_id))
            self._to_offload.clear()
            self._stored_on_tier(stored, "copied from GPU blocks about to be reused")
        if self._cpu_held:
            self.cpu.free(self._cpu_held)
            self._cpu_held = []
        return mapping

    def copy_ahead(self, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """Write-back ahead of need: the cached GPU blocks among the next `horizon` the
        free queue hands out that the CPU tier lacks (at most max_blocks) get CPU blocks
        now. The runner may copy them while this step's forward pass runs: they are free,
        so it neither reads nor writes them. When the pool reuses them later,
        flush_offloads finds their hash on the tier and copies nothing: the copy is off
        that step's critical path. Call after flush_offloads, for a step that runs."""
        mapping: list[tuple[int, int]] = []
        stored: list[KVBlock] = []
        cpu, uncomputed, seen = self.cpu, self.uncomputed, 0
        for block in self.gpu.free_queue:
            if seen == horizon or len(stored) == max_blocks:
                break
            seen += 1
            block_hash = block.block_hash
            if block_hash is None or block.block_id in uncomputed \
                    or cpu.get_cached(block_hash) is not None:
                continue
            if not cpu.num_free:
                break
            target = self._tier_block(block_hash)
            stored.append(target)
            mapping.append((block.block_id, target.block_id))
        self._stored_on_tier(stored, "copied ahead from GPU blocks next in line for reuse")
        return mapping

    def _tier_block(self, block_hash: BlockHash) -> KVBlock:
        """A CPU block registered under the hash, free and the tier's most recently used
        (the caller checked that one is free)."""
        block = self.cpu.take_new(1)[0]
        self.cpu.cache(block, block_hash)
        self.cpu.free([block])
        return block

    def _stored_on_tier(self, stored: list[KVBlock], how: str) -> None:
        """Account for CPU blocks the coming copies fill (counted, events, and forgotten
        again if the step fails)."""
        if not stored:
            return
        self.num_blocks_offloaded += len(stored)
        self.cpu_uncomputed.extend(stored)
        self._emit("BlockStored", pool="cpu", block_ids=[b.block_id for b in stored],
                   block_hashes=[short(b.block_hash) for b in stored],
                   ref_cnts=[0] * len(stored), detail=f"CPU tier: {how}")
        if self._events.external is None:
            return
        for block in stored:
            parent, tokens = self._hash_tokens.get(block.block_hash, (None, []))
            self._events.external.append(("stored", [block.block_hash], parent, tokens, "CPU"))

    def mark_computed(self) -> None:
        """The step ran: the blocks registered for it hold their K/V."""
        self.uncomputed.clear()
        self.cpu_uncomputed.clear()

    # --- swap --------------------------------------------------------------------------
    def swap_out(self, request: Request) -> SwapResult | None:
        """Move the request's GPU blocks to new CPU blocks. None if the CPU pool is short."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        if rid in self.req_to_cpu_blocks:
            raise RuntimeError(f"invariant: {rid} is already swapped out")
        if len(table) > self.cpu.num_free:
            return None
        cpu_blocks = self.cpu.take_new(len(table))
        mapping = [(g.block_id, c.block_id) for g, c in zip(table, cpu_blocks)]
        self.req_to_cpu_blocks[rid] = cpu_blocks
        self._num_offered.pop(rid, None)
        self._shared_tail.discard(rid)
        del self.req_to_blocks[rid]
        self._step_ids.pop(rid, None)
        self.gpu.free(reversed(table))  # cached ones stay findable until reused
        return SwapResult(mapping)

    def swap_in(self, request: Request) -> SwapResult | None:
        """Bring a swapped request's blocks back to the GPU pool. Leading blocks still in
        the prefix cache are reused instead of copied. None if the GPU pool is short."""
        rid = request.request_id
        cpu_table = self.req_to_cpu_blocks.get(rid)
        if cpu_table is None:
            raise RuntimeError(f"invariant: {rid} holds no CPU blocks")
        hits: list[KVBlock] = []
        if self.enable_caching and not self._window_freed.get(rid):  # (hits start at block 0)
            num_full = request.num_computed_tokens // self.block_size
            for block_hash in self.hashes(request, 0, num_full):
                block = self.gpu.get_cached(block_hash)
                if block is None:
                    break
                hits.append(block)
        num_new = len(cpu_table) - len(hits)
        if num_new + sum(1 for b in hits if b.ref_cnt == 0) > self.gpu.num_free:
            return None
        self.gpu.touch(hits)
        new_blocks = self.gpu.take_new(num_new)
        self.req_to_blocks[rid] = hits + new_blocks
        mapping = [(c.block_id, g.block_id) for c, g in zip(cpu_table[len(hits):], new_blocks)]
        del self.req_to_cpu_blocks[rid]
        # Released by flush_offloads, once this step's offloads have their CPU blocks
        # (an offload must not overwrite a block that a swap-in of the same step reads)
        self._cpu_held.extend(reversed(cpu_table))
        self._num_offered[rid] = len(hits) + self._window_freed.get(rid, 0)
        self._offer_to_cache(request, request.num_computed_tokens)
        return SwapResult(mapping, num_hit_blocks=len(hits))

    def forget_uncomputed(self) -> int:
        """A step failed: the blocks registered for it hold no valid K/V. Drop their hashes."""
        dropped = []
        for block_id in self.uncomputed:
            block = self.gpu.blocks[block_id]
            block_hash = block.block_hash
            if self.gpu.forget(block):
                dropped.append((block_id, block_hash))
        self.uncomputed.clear()
        cpu_dropped = [(b.block_id, b.block_hash) for b in self.cpu_uncomputed
                       if b.block_hash is not None]
        for block in self.cpu_uncomputed:
            self.cpu.forget(block)
        self.cpu_uncomputed.clear()
        if cpu_dropped and self._events.external is not None:
            self._events.external.append(("removed", [h for _, h in cpu_dropped], "CPU"))
        if cpu_dropped:
            self._emit("BlockEvicted", pool="cpu", detail="step failed",
                       block_ids=[b for b, _ in cpu_dropped],
                       block_hashes=[short(h) for _, h in cpu_dropped],
                       ref_cnts=[0] * len(cpu_dropped))
        if dropped and self._events.external is not None and not self.group:
            self._events.external.append(("removed", [h for _, h in dropped]))
        self._forget_tokens([h for _, h in dropped + cpu_dropped])
        if dropped:
            self._emit("BlockEvicted", detail="step failed",
                       block_ids=[b for b, _ in dropped],
                       block_hashes=[short(h) for _, h in dropped],
                       ref_cnts=[self.gpu.blocks[b].ref_cnt for b, _ in dropped])
        return len(dropped)

    # --- operator: evict, reset, pin ------------------------------------------------------
    def evict(self, n: int | None) -> int:
        victims = self.gpu.evict(n)
        if victims and self._events.external is not None:
            self._external_removed([(b.block_id, h) for b, h in victims])
        self._forget_tokens([h for _, h in victims])
        if victims:
            self._emit("BlockEvicted", detail="operator",
                       block_ids=[b.block_id for b, _ in victims],
                       block_hashes=[short(h) for _, h in victims],
                       ref_cnts=[0] * len(victims))
        return len(victims)

    def reset_prefix_cache(self) -> dict:
        unpinned = [b for b in self.gpu.blocks if b.pinned]
        for block in unpinned:
            self.gpu.unpin(block)
        n = self.gpu.forget_all_hashes()
        n_cpu = self.cpu.forget_all_hashes()
        self._hash_tokens.clear()
        if self._events.external is not None:
            self._events.external.append(("cleared",))
        self._emit("AllBlocksCleared", num_tokens=n * self.block_size,
                   detail=f"{n} cached blocks forgotten, {len(unpinned)} unpinned"
                   + (f", {n_cpu} on the CPU tier" if n_cpu else ""))
        return {"num_blocks_forgotten": n, "num_blocks_unpinned": len(unpinned),
                "num_cpu_blocks_forgotten": n_cpu}

    def cached_chain(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Leading blocks of this hash chain that are cached now."""
        out = []
        for block_hash in hashes:
            block = self.gpu.get_cached(block_hash)
            if block is None:
                break
            out.append(block)
        return out

    def pin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        newly = [b for b in blocks if self.gpu.pin(b)]
        if newly:
            self._emit("Pinned", block_ids=[b.block_id for b in newly],
                       block_hashes=[short(b.block_hash) for b in newly],
                       ref_cnts=[b.ref_cnt for b in newly])
        return newly

    def unpin(self, blocks: list[KVBlock]) -> list[KVBlock]:
        released = [b for b in blocks if self.gpu.unpin(b)]
        if released:
            self._emit("Unpinned", block_ids=[b.block_id for b in released],
                       block_hashes=[short(b.block_hash) for b in released],
                       ref_cnts=[b.ref_cnt for b in released])
        return released

    # --- introspection ---------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

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

    def cpu_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cpu_blocks.get(request_id, ())]

    @property
    def groups(self) -> tuple[KVCacheManager]:
        """The managers of every layer group's tables: this one."""
        return (self,)

    def group_tables(self, pool: str = "gpu") -> list:
        """Other layer groups' tables (HybridKVCacheManager): none."""
        return []

    def num_blocks_held(self, request_id: str) -> int:
        """GPU blocks the request holds (a hybrid model's: in every layer group)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def num_cpu_blocks_held(self, request_id: str) -> int:
        return len(self.req_to_cpu_blocks.get(request_id, ()))

    def check_invariants(self) -> None:
        """Raise if any bookkeeping invariant is broken (used by tests and debug runs)."""
        held = {"cpu": self._cpu_held}  # read by this step's copies until flush_offloads
        for pool, tables in ((self.gpu, self.req_to_blocks), (self.cpu, self.req_to_cpu_blocks)):
            holders = Counter(b.block_id for table in tables.values() for b in table)
            holders.update(b.block_id for b in held.get(pool.pool, ()))
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
