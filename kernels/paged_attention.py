"""paged_attention: one varlen kernel for prefill chunks and decodes over a paged KV cache.

The batch's new tokens are concatenated in `q`; sequence s owns rows
query_start_loc[s]:query_start_loc[s+1]. Its new tokens' K/V are already in the
cache (reshape_and_cache ran first), so the kernel only reads the cache: query row j
of sequence s sits at position seq_lens[s] - q_len_s + j and attends causally to
positions 0..that position, read through block_tables[s]. A decode is a chunk of one
token, a plain prefill a chunk with nothing cached before it.

Work split (program = one tile of queries of one sequence, for one KV head, one split):
* A query tile holds BLOCK_Q tokens of one sequence times the GROUP query heads that
  share the KV head, so BLOCK_M = BLOCK_Q * GROUP_PAD rows read each K/V tile once.
* Tiles are numbered without knowing the query lengths on the host: sequence s's
  tiles start at query_start_loc[s] // BLOCK_Q + s, so num_tokens // BLOCK_Q + num_seqs
  programs always suffice; a program finds its sequence by binary search and exits if
  it is past the end of that sequence's tokens.
* Split-KV ("flash-decoding"): with NUM_SPLITS > 1 each program covers one slice of
  the context and writes an unnormalised partial (acc, running max, running sum); a
  second kernel merges the slices. This fills the GPU when few long decodes run.
Softmax runs online in fp32 in the log2 domain (exp2 with scale * log2(e)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _checks as checks
from kernels._triton import cdiv, interpreting, lazy_jit, next_power_of_2, tl

_OP = "paged_attention"
_Q_LAYOUT = "[num_tokens, num_q_heads, head_dim]"
_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
_LOG2E = 1.4426950408889634

MAX_HEAD_DIM = 256  # the fp32 accumulator is BLOCK_M x head_dim registers per program
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in merging than it saves


@lazy_jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], contiguous (used when NUM_SPLITS == 1)
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, head_dim] fp32 (NUM_SPLITS > 1)
    part_max_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32, log2 domain
    part_sum_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    q_ptr,  # [num_tokens, num_q_heads, head_dim], last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache_ptr,  # same layout as key_cache
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32, context length including the new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_block_table,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (the interpreter has no bf16 math)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so they are not rounded to tf32
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Binary search: the last sequence whose first tile id is <= tile_id.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_q0 = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of the tile in its chunk
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len  # tokens of this sequence before the chunk

    # Row r of the tile: token tile_q0 + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M)
    row_tok = tile_q0 + rows // GROUP_PAD
    row_head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows % GROUP_PAD < GROUP) & (row_tok < q_len)
    row_pos = num_cached + row_tok  # position in the sequence; sees keys 0..row_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_offs = ((q_start + row_tok).to(tl.int64) * stride_q_tok + row_head * stride_q_head)[:, None] + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile needs: 0 .. last row's position; this split takes an even share of tiles.
    kv_end = num_cached + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE_N), NUM_SPLITS)
    kv_lo = split * tiles_per_split * TILE_N
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(kv_lo, kv_hi, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        key_ok = keys < kv_hi
        block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_offs = (block * BLOCK_SIZE + keys % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        k = tl.load(key_cache_ptr + kv_offs[None, :] + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
        v = tl.load(value_cache_ptr + kv_offs[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = (keys[None, :] <= row_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    row_tok64 = (q_start + row_tok).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = ((row_tok64 * NUM_Q_HEADS + row_head) * HEAD_DIM)[:, None] + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part_row = (row_tok64 * NUM_Q_HEADS + row_head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + (part_row * HEAD_DIM)[:, None] + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])


@lazy_jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], contiguous
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, head_dim] fp32
    part_max_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32, log2 domain
    part_sum_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [num_seqs + 1]; rows past its last entry were never computed
    num_seqs,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    part_row = (tok * NUM_Q_HEADS + head) * NUM_SPLITS + splits

    # An empty split (no visible key) wrote m = -inf, l = 0, acc = 0: its weight is 0.
    m = tl.load(part_max_ptr + part_row, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part_row, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (part_row * HEAD_DIM)[:, None] + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.math.exp2(m - m_max)
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (tok * NUM_Q_HEADS + head) * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_q: int  # query tokens per tile
    group_pad: int  # query heads per KV head, rounded up to a power of two
    tile_n: int  # keys per inner iteration
    num_splits: int  # KV splits per query tile (1: no merge kernel)
    num_warps: int


def choose_num_splits(num_q_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits per query tile: enough programs for ~2 waves, but no split under
    MIN_TOKENS_PER_SPLIT keys. Many tiles (prefill, big decode batches) get 1."""
    programs = max(1, num_q_tiles * num_kv_heads)
    wanted = cdiv(2 * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_launch_config(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int,
    max_query_len: int,
    num_sms: int,
    num_splits: int | None,
) -> LaunchConfig:
    group_pad = next_power_of_2(num_q_heads // num_kv_heads)
    # 16 rows is the smallest tl.dot; longer chunks (prefill) reuse K/V over 64 rows.
    rows = 64 if max_query_len >= 64 else 16
    block_q = max(1, rows // group_pad)
    if interpreting():
        tile_n = 16  # small tiles so short test sequences still cross tiles and splits
    elif dtype == torch.float32 or head_dim > 128:
        tile_n = 32
    else:
        tile_n = 64
    if num_splits is None:
        num_q_tiles = min(num_tokens, num_tokens // block_q + num_seqs)
        num_splits = choose_num_splits(num_q_tiles, num_kv_heads, max_seq_len, num_sms)
    num_warps = 8 if block_q * group_pad * next_power_of_2(head_dim) >= 64 * 128 else 4
    return LaunchConfig(block_q, group_pad, tile_n, num_splits, num_warps)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged context; returns out.

    q: [num_tokens, num_q_heads, head_dim], fp32/fp16/bf16, last dim contiguous; the
        new tokens of all sequences concatenated.
    key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim],
        q's dtype; block_size a power of two. num_q_heads % num_kv_heads == 0.
    block_tables: [num_seqs, max_blocks_per_seq] int32; entries past
        cdiv(seq_lens[s], block_size) are never read.
    seq_lens: [num_seqs] int32, context length including the new tokens (>= q_len).
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths starting at 0.
        Rows of q past query_start_loc[-1] are padding; their output is unspecified.
    scale: softmax scale, usually head_dim ** -0.5.
    out: optional contiguous output [num_tokens, num_q_heads, head_dim] in q's dtype.
    num_splits: force the number of KV splits (tests); None picks it from the context
        length and the batch so that few long decodes still fill the GPU.
    max_seq_len, max_query_len: optional host-side bounds used only to pick tile
        sizes and splits; default to bounds derived from shapes (no device sync).
    """
    _check_args(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"{_OP}: num_splits must be in 1..1024 or None, got {num_splits}")
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if max_query_len is None:
        # exact bound when every sequence has at least one new token; a heuristic otherwise
        max_query_len = max(1, num_tokens - num_seqs + 1)
    cfg = choose_launch_config(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                               q.dtype, max_seq_len, max_query_len, _num_sms(q.device), num_splits)

    if cfg.num_splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, cfg.num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_q_heads, cfg.num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched when NUM_SPLITS == 1

    upcast = interpreting() and q.dtype == torch.bfloat16
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, cfg.num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        GROUP=num_q_heads // num_kv_heads,
        GROUP_PAD=cfg.group_pad,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32",
        num_warps=cfg.num_warps,
    )
    if cfg.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, num_seqs,
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_power_of_2(head_dim),
            NUM_SPLITS=cfg.num_splits,
            SPLITS_PAD=next_power_of_2(cfg.num_splits),
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no occupancy to fill; tests force splits explicitly


def _check_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    checks.check_ndim(_OP, "q", q, 3, _Q_LAYOUT)
    checks.check_ndim(_OP, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "value_cache", value_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    checks.check_ndim(_OP, "seq_lens", seq_lens, 1, "[num_seqs]")
    checks.check_ndim(_OP, "query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{_OP}: value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    checks.check_dim_size(_OP, "key_cache", key_cache, 3, head_dim, "q.shape[2] (head_dim)")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"{_OP}: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    checks.check_power_of_two(_OP, "block_size (key_cache.shape[1])", block_size)
    num_seqs = block_tables.shape[0]
    checks.check_dim_size(_OP, "seq_lens", seq_lens, 0, num_seqs, "block_tables.shape[0] (num_seqs)")
    checks.check_dim_size(_OP, "query_start_loc", query_start_loc, 0, num_seqs + 1,
                          "num_seqs + 1")
    checks.check_dtype(_OP, "q", q, checks.ATTENTION_DTYPES)
    checks.check_same_dtype(_OP, ("q", "key_cache", "value_cache"), (q, key_cache, value_cache))
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        checks.check_dtype(_OP, name, t, (torch.int32,))
    checks.check_last_dim_contiguous(_OP, "q", q)
    checks.check_contiguous(_OP, "key_cache", key_cache, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "value_cache", value_cache, _CACHE_LAYOUT)
    checks.check_last_dim_contiguous(_OP, "block_tables", block_tables)
    checks.check_contiguous(_OP, "seq_lens", seq_lens, "[num_seqs]")
    checks.check_contiguous(_OP, "query_start_loc", query_start_loc, "[num_seqs + 1]")
    names = ["q", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc"]
    tensors = [q, key_cache, value_cache, block_tables, seq_lens, query_start_loc]
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(
                f"{_OP}: out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}, got "
                f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}"
            )
        names.append("out")
        tensors.append(out)
    checks.check_same_device(_OP, names, tensors)
    checks.check_triton_device(_OP, q)
