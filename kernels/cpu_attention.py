"""Paged attention in plain torch, vectorised: the CPU path and the fallback.

Same contract as kernels.paged_attention (causal varlen attention of new tokens over
their paged context, the new tokens' K/V already in the cache), split in two so that
a forward pass pays for the bookkeeping once instead of once per layer:

* plan_attention(...) turns the batch's block tables and lengths into gather indices
  and masks (host work, once per step);
* paged_attention(q, key_cache, value_cache, plan, scale) runs one layer with tensor
  ops only: no Python loop over tokens.

Decodes (one new token) are batched: their blocks are gathered with one index_select
per cache into [seqs, blocks * block_size, kv_heads, head_dim] and attended with one
masked flash-attention call. Sequences are grouped by context length so a short
sequence is not padded to the longest one. Decodes whose tables start with the same
blocks (a prompt prefix served by the prefix cache) attend to those blocks once, all
together ("cascade" attention): the shared part and each sequence's own part are
attended separately and merged with their log-sum-exps, so a shared system prompt is
gathered once per step instead of once per sequence. A chunk of several new tokens
(prefill) gets its own causal SDPA call; one with nothing cached before it attends to
its fresh K/V directly instead of reading them back from the cache.

With `native=True` (float32 on a CPU where kernels/cpu_ext.py could build its
kernels), the batch goes to the C++ kernels instead, which read K/V where they lie in
the cache: no gather, no grouping, no cascade (a shared prefix is read from the CPU's
caches by every sequence). Decodes and chunks of a few tokens go to
kvops::paged_decode_attention, each row a query that sees the context up to its own
position; longer chunks to kvops::paged_prefill_attention, which takes 16 rows at a
time (2-3x the rate of one row at a time, and of SDPA: python -m benchmarks.bench_cpu
attention). One call of each per layer, whatever the number of chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A decode group stops growing when padding would exceed this fraction of its real
# context: bounds wasted gather traffic without launching a group per sequence.
MAX_PADDING_FRACTION = 0.25
# Decodes sharing at least this many leading blocks attend to them together.
MIN_SHARED_BLOCKS = 2
# With the C++ kernels, chunks of at least this many tokens go to paged_prefill_attention
# (16 rows per vector: below 8 most lanes would idle), shorter ones row by row to
# paged_decode_attention.
NATIVE_CHUNK_MIN_ROWS = 8

# Flash attention that also returns the log-sum-exp of each query's scores (what
# F.scaled_dot_product_attention calls on CPU for 4-d inputs); needed to merge the
# shared-prefix and own-blocks halves of a cascade.
_cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_mask: torch.Tensor | None = None,
                     scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over [B, H, Lq, D] queries and [B, KV, Lk, D] keys and values (KV divides
    H), with the log-sum-exp [B, H, Lq] of each query's scores. On the CPU, aten's flash
    kernel; elsewhere (this torch path run on a GPU: tests, a backend chosen by hand) the
    same in plain tensor algebra, in float32."""
    if q.device.type == "cpu":
        return _cpu_flash_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return _attention_with_lse(q, k, v, attn_mask, scale)


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if attn_mask is not None:
        scores = scores + attn_mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor  # [n] int64: q rows of these sequences (one new token each), ascending
    row_range: tuple[int, int] | None  # (first, last + 1) when rows are consecutive
    block_ids: torch.Tensor  # [n * max_blocks] int64: padded block tables, flattened
    num_seqs: int
    max_blocks: int
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] float: 0 or -inf (padding)


@dataclass(slots=True)
class SharedPrefix:
    rows: torch.Tensor  # [n] int64: q rows of the decodes whose tables start with block_ids
    block_ids: torch.Tensor  # [num_blocks] int64: the shared leading blocks (all full)


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # its rows of q: [q_start, q_end)
    q_end: int
    context_len: int  # tokens of context including the new ones
    block_ids: torch.Tensor  # [cdiv(context_len, block_size)] int64
    mask: torch.Tensor | None  # [q_len, context_len] float, 0 or -inf; None: no prefix, causal


@dataclass(slots=True)
class NativeRows:
    """Query rows for kvops::paged_decode_attention: each attends to the first
    seq_lens[i] tokens of block_tables[i] (a decode: its whole context; a prefill row:
    the context up to and including its own position)."""
    rows: torch.Tensor  # [n] int64: q rows
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [n] int32


@dataclass(slots=True)
class NativeChunks:
    """Chunks for kvops::paged_prefill_attention: rows [q_starts[c], + q_lens[c]) sit at
    the last q_lens[c] positions of the first seq_lens[c] tokens of block_tables[c]."""
    q_starts: torch.Tensor  # [n] int64
    q_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [n] int32


@dataclass(slots=True)
class CpuAttentionPlan:
    num_tokens: int
    decode_groups: list[DecodeGroup]  # over each decode's own blocks (after a shared prefix)
    shared_prefixes: list[SharedPrefix]
    prefills: list[PrefillChunk]
    native_rows: NativeRows | None = None  # instead of the groups and prefixes
    native_chunks: NativeChunks | None = None  # instead of prefills


def plan_attention(block_tables: list[list[int]], seq_lens: list[int],
                   query_start_loc: list[int], block_size: int,
                   device: torch.device | str = "cpu", native: bool = False,
                   chunk_min_rows: int = NATIVE_CHUNK_MIN_ROWS) -> CpuAttentionPlan:
    """Host-side bookkeeping for one batch (plain lists in, tensors on `device` out).

    block_tables[s] lists at least cdiv(seq_lens[s], block_size) blocks; seq_lens[s]
    counts the context including the new tokens; query_start_loc has num_seqs + 1
    entries. native: plan for the C++ kernels (the caller checked that they are
    available): chunks of at least chunk_min_rows tokens for paged_prefill_attention,
    the rest row by row for paged_decode_attention."""
    decodes, prefills = [], []
    native_rows, native_chunks = [], []  # (q_start, q_len, seq_len, blocks) for the kernels
    for s, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[s], query_start_loc[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {s}: {q_len} new tokens but seq_len {seq_len}")
        num_blocks = -(-seq_len // block_size)
        if len(block_tables[s]) < num_blocks:
            raise ValueError(f"sequence {s}: {seq_len} tokens need {num_blocks} blocks, "
                             f"its table has {len(block_tables[s])}")
        blocks = block_tables[s][:num_blocks]
        if native:
            (native_chunks if q_len >= chunk_min_rows else native_rows).append(
                (q_start, q_len, seq_len, blocks))
        elif q_len == 1:
            decodes.append((q_start, seq_len, blocks))
        else:
            prefills.append(_prefill_chunk(q_start, q_end, seq_len, blocks, device))
    if native:
        return CpuAttentionPlan(query_start_loc[-1], [], [], [],
                                _native_rows(native_rows, device) if native_rows else None,
                                _native_chunks(native_chunks, device) if native_chunks else None)
    decodes, shared = _split_shared_prefixes(decodes, block_size, device)
    groups = [_decode_group(g, block_size, device) for g in _group_by_length(decodes)]
    return CpuAttentionPlan(query_start_loc[-1], groups, shared, prefills)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: CpuAttentionPlan, scale: float,
                    new_key: torch.Tensor | None = None,
                    new_value: torch.Tensor | None = None,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one layer. q: [num_tokens, q_heads, head_dim]; caches:
    [num_blocks, block_size, kv_heads, head_dim]; new_key/new_value: the batch's new
    K/V [num_tokens, kv_heads, head_dim] (already in the cache; passing them lets a
    prefill without prefix skip reading them back). kv_scales: (k_scale, v_scale),
    [kv_heads] float32 each, for fp8 caches (kernels/fp8.py): what is gathered is
    dequantised to q's dtype (not with the C++ kernels, which read float32 caches).
    Returns [num_tokens, q_heads, head_dim]."""
    if kv_scales is not None:
        if plan.native_rows is not None or plan.native_chunks is not None:
            raise ValueError("the C++ attention kernels read float32 caches, not fp8")
        key_cache = _Dequantized(key_cache, kv_scales[0], q.dtype)
        value_cache = _Dequantized(value_cache, kv_scales[1], q.dtype)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if plan.native_rows is not None:
        d = plan.native_rows
        torch.ops.kvops.paged_decode_attention(out, q, key_cache, value_cache, d.rows,
                                               d.block_tables, d.seq_lens, scale)
    if plan.native_chunks is not None:
        c = plan.native_chunks
        torch.ops.kvops.paged_prefill_attention(out, q, key_cache, value_cache, c.q_starts,
                                                c.q_lens, c.block_tables, c.seq_lens, scale)
    lse = q.new_empty(num_tokens, num_heads, dtype=torch.float32) if plan.shared_prefixes else None
    for group in plan.decode_groups:
        o, group_lse = _attend_decodes(q, key_cache, value_cache, group, scale)  # [n, H, D], [n, H]
        if group.row_range is not None:
            out[group.row_range[0]:group.row_range[1]] = o
        else:
            out.index_copy_(0, group.rows, o)
        if lse is not None:
            lse.index_copy_(0, group.rows, group_lse)
    for prefix in plan.shared_prefixes:
        _merge_shared_prefix(q, key_cache, value_cache, prefix, scale, out, lse)
    for chunk in plan.prefills:
        out[chunk.q_start:chunk.q_end] = _attend_chunk(
            q, key_cache, value_cache, chunk, scale, new_key, new_value)
    return out


def paged_attention_varlen(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels.paged_attention's signature, for tests and one-off calls."""
    plan = plan_attention(block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist(),
                          key_cache.shape[1], q.device)
    return paged_attention(q, key_cache, value_cache, plan, scale)


# --- one layer ---------------------------------------------------------------------------

class _Dequantized:
    """An fp8 cache as the functions below read it: index_select returns the picked
    blocks dequantised (stored value * the head's scale) in the compute dtype."""

    def __init__(self, cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.cache, self.scale, self.dtype = cache, scale, dtype
        self.shape = cache.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        from kernels.fp8 import dequantize

        return dequantize(self.cache.index_select(dim, index), self.scale, self.dtype)


def _attend_decodes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    group: DecodeGroup, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    n, nb = group.num_seqs, group.max_blocks
    _, block_size, kv_heads, head_dim = key_cache.shape
    # [n, nb * block_size, kv_heads, head_dim] -> [n, kv_heads, nb * block_size, head_dim] views
    k = key_cache.index_select(0, group.block_ids).view(n, nb * block_size, kv_heads, head_dim)
    v = value_cache.index_select(0, group.block_ids).view(n, nb * block_size, kv_heads, head_dim)
    qg = q.index_select(0, group.rows).unsqueeze(2)  # [n, H, 1, D]
    o, lse = _flash_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask,
                              scale=scale)
    return o.squeeze(2), lse.squeeze(2)  # [n, H, D], [n, H]


def _merge_shared_prefix(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         prefix: SharedPrefix, scale: float, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    """Attend prefix.rows' queries to the shared blocks (every query sees all of them)
    and fold the result into their rows of out, which hold the attention over their
    own blocks with log-sum-exp lse."""
    kv_heads, head_dim = key_cache.shape[2:]
    k = key_cache.index_select(0, prefix.block_ids).view(1, -1, kv_heads, head_dim)
    v = value_cache.index_select(0, prefix.block_ids).view(1, -1, kv_heads, head_dim)
    qs = q.index_select(0, prefix.rows).transpose(0, 1)[None]  # [1, H, n, D]: n queries
    o_shared, lse_shared = _flash_attention(qs, k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    o_shared = o_shared[0].transpose(0, 1)  # [n, H, D]
    lse_shared = lse_shared[0].transpose(0, 1)  # [n, H]
    # The softmax over both parts is each part's softmax weighted by its share of the
    # mass: e^lse_shared / (e^lse_shared + e^lse_own).
    w_shared = torch.sigmoid(lse_shared - lse.index_select(0, prefix.rows))[..., None]
    o_own = out.index_select(0, prefix.rows)
    merged = torch.lerp(o_own, o_shared, w_shared.to(o_own.dtype))  # [n, H, D]
    out.index_copy_(0, prefix.rows, merged)


def _attend_chunk(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  chunk: PrefillChunk, scale: float, new_key: torch.Tensor | None,
                  new_value: torch.Tensor | None) -> torch.Tensor:
    # SDPA takes its fused CPU kernel only for 4-d inputs: [1, heads, tokens, head_dim].
    qs = q[chunk.q_start:chunk.q_end].transpose(0, 1)[None]  # [1, H, q_len, D]
    if chunk.mask is None and new_key is not None and new_value is not None:
        k = new_key[chunk.q_start:chunk.q_end]  # [q_len, kv_heads, D]
        v = new_value[chunk.q_start:chunk.q_end]
    else:
        k = _gather(key_cache, chunk)  # [context_len, kv_heads, D]
        v = _gather(value_cache, chunk)
    o = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)  # [q_len, H, D]


def _gather(cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, chunk.block_ids)
    return blocks.view(-1, kv_heads, head_dim)[:chunk.context_len]


# --- planning ------------------------------------------------------------------------------

def _prefill_chunk(q_start: int, q_end: int, seq_len: int, blocks: list[int],
                   device: torch.device | str) -> PrefillChunk:
    q_len = q_end - q_start
    mask = None  # nothing before the chunk: plain causal attention
    if q_len < seq_len:
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        hidden = torch.arange(seq_len, device=device)[None, :] > q_pos[:, None]
        # additive, made once per step (SDPA would convert a boolean mask in every layer)
        mask = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
    return PrefillChunk(q_start, q_end, seq_len,
                        torch.tensor(blocks, dtype=torch.int64, device=device), mask)


def _padded_tables(entries: list[tuple[int, int, int, list[int]]]) -> torch.Tensor:
    """entries' block lists as one int32 [n, max_blocks] tensor, padded with block 0."""
    max_blocks = max(len(blocks) for *_, blocks in entries)
    flat: list[int] = []
    for *_, blocks in entries:
        flat.extend(blocks)
        flat.extend([0] * (max_blocks - len(blocks)))
    return torch.tensor(flat, dtype=torch.int32).view(len(entries), max_blocks)


def _native_chunks(entries: list[tuple[int, int, int, list[int]]],
                   device: torch.device | str) -> NativeChunks:
    """entries: (q_start, q_len, seq_len, blocks)."""
    return NativeChunks(torch.tensor([e[0] for e in entries]).to(device),
                        torch.tensor([e[1] for e in entries], dtype=torch.int32).to(device),
                        _padded_tables(entries).to(device),
                        torch.tensor([e[2] for e in entries], dtype=torch.int32).to(device))


def _native_rows(entries: list[tuple[int, int, int, list[int]]],
                 device: torch.device | str) -> NativeRows:
    """entries: (q_start, q_len, seq_len, blocks). Row q_start + i of a chunk sits at
    position seq_len - q_len + i and sees that many keys plus one (causal)."""
    tables = _padded_tables(entries)
    q_lens = torch.tensor([q_len for _, q_len, _, _ in entries])
    if int(q_lens.max()) > 1:
        tables = tables.repeat_interleave(q_lens, dim=0)
    rows = torch.cat([torch.arange(q_start, q_start + q_len) for q_start, q_len, _, _ in entries])
    seq_lens = torch.cat([torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
                          for _, q_len, seq_len, _ in entries])
    return NativeRows(rows.to(device), tables.to(device), seq_lens.to(device))


def _split_shared_prefixes(decodes: list[tuple[int, int, list[int]]], block_size: int,
                           device: torch.device | str
                           ) -> tuple[list[tuple[int, int, list[int]]], list[SharedPrefix]]:
    """Find decodes whose tables start with the same blocks (at least MIN_SHARED_BLOCKS
    of them, each decode keeping at least one token of its own). Returns the decodes
    cut down to their own blocks, and the shared prefixes."""
    by_first: dict[int, list[tuple[int, int, list[int]]]] = {}
    for d in decodes:
        by_first.setdefault(d[2][0], []).append(d)
    own, shared = [], []
    for cluster in by_first.values():
        n_shared = _common_prefix_len([blocks for _, _, blocks in cluster])
        n_shared = min(n_shared, (min(seq_len for _, seq_len, _ in cluster) - 1) // block_size)
        if len(cluster) < 2 or n_shared < MIN_SHARED_BLOCKS:
            own.extend(cluster)
            continue
        cut = n_shared * block_size
        own.extend((row, seq_len - cut, blocks[n_shared:]) for row, seq_len, blocks in cluster)
        shared.append(SharedPrefix(
            rows=torch.tensor([row for row, _, _ in cluster], dtype=torch.int64, device=device),
            block_ids=torch.tensor(cluster[0][2][:n_shared], dtype=torch.int64, device=device)))
    return own, shared


def _common_prefix_len(tables: list[list[int]]) -> int:
    n = min(len(t) for t in tables)
    for i in range(n):
        if any(t[i] != tables[0][i] for t in tables):
            return i
    return n


def _group_by_length(decodes: list[tuple[int, int, list[int]]]) -> list[list[tuple]]:
    """Split decodes (longest first) into groups whose padding stays under
    MAX_PADDING_FRACTION of their real context."""
    ordered = sorted(decodes, key=lambda d: -d[1])
    groups: list[list[tuple]] = []
    for d in ordered:
        if groups:
            group = groups[-1]
            longest = group[0][1]
            real = sum(x[1] for x in group) + d[1]
            if longest * (len(group) + 1) <= real * (1 + MAX_PADDING_FRACTION):
                group.append(d)
                continue
        groups.append([d])
    return groups


def _decode_group(decodes: list[tuple[int, int, list[int]]], block_size: int,
                  device: torch.device | str) -> DecodeGroup:
    decodes = sorted(decodes)  # by q row: consecutive rows need no scatter
    max_blocks = max(len(blocks) for _, _, blocks in decodes)
    flat = []
    for _, _, blocks in decodes:
        # Padding repeats a real block: its slots are masked out anyway.
        flat.extend(blocks + [blocks[0]] * (max_blocks - len(blocks)))
    lens = [seq_len for _, seq_len, _ in decodes]
    mask = None
    if min(lens) != max_blocks * block_size:
        positions = torch.arange(max_blocks * block_size, device=device)
        lens_t = torch.tensor(lens, device=device)
        padding = (positions[None, :] >= lens_t[:, None])[:, None, None, :]
        mask = torch.zeros(padding.shape, device=device).masked_fill_(padding, float("-inf"))
    rows = [row for row, _, _ in decodes]
    consecutive = rows[-1] - rows[0] == len(rows) - 1
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        row_range=(rows[0], rows[-1] + 1) if consecutive else None,
        block_ids=torch.tensor(flat, dtype=torch.int64, device=device),
        num_seqs=len(decodes), max_blocks=max_blocks, mask=mask)


# --- sliding windows and soft-capped scores ---------------------------------------------

def windowed_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: list[list[int]], seq_lens: list[int],
                       query_start_loc: list[int], scale: float, window: int | None = None,
                       softcap: float | None = None,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of layers with a sliding window (a query at position p sees positions
    p - window + 1 .. p) and/or soft-capped scores (cap * tanh(score / cap), Gemma 2),
    on any device: one sequence at a time, reading only the blocks its window reaches,
    scores in float32. The new tokens' K/V are already in the caches. Arguments as
    plan_attention's and paged_attention's; returns [num_tokens, q_heads, head_dim]."""
    if kv_scales is not None:
        key_cache = _Dequantized(key_cache, kv_scales[0], torch.float32)
        value_cache = _Dequantized(value_cache, kv_scales[1], torch.float32)
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    out = q.new_zeros(num_tokens, num_heads, head_dim)
    for s, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[s], query_start_loc[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first = max(0, seq_len - q_len - window + 1) if window else 0  # the first row's reach
        b0, b1 = first // block_size, -(-seq_len // block_size)
        blocks = torch.tensor(block_tables[s][b0:b1], dtype=torch.int64, device=q.device)
        k = key_cache.index_select(0, blocks).flatten(0, 1).float()  # [n_slots, Hkv, D]
        v = value_cache.index_select(0, blocks).flatten(0, 1).float()
        k_pos = torch.arange(b0 * block_size, b1 * block_size, device=q.device)[None, :]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        visible = k_pos <= q_pos  # [q_len, n_slots]; also hides the slots past seq_len
        if window:
            visible &= k_pos > q_pos - window
        qs = q[q_start:q_end].float().view(q_len, kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,khd->hgnk", qs, k).mul_(scale)
        if softcap:
            scores.div_(softcap).tanh_().mul_(softcap)
        probs = scores.masked_fill_(~visible, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hgnk,khd->nhgd", probs, v)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out
