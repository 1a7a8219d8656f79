"""Triton kernels for paged_attention (launcher, checks and the work split it
relies on: kernels/paged_attention.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `tile_id`: sequence s's tiles are numbered from
    query_start_loc[s] // BLOCK_Q + s, so binary-search the last s whose first tile id
    is <= tile_id."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
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
    k_scale_ptr,  # FP8: [num_kv_heads] float32, the cache holds k / scale
    v_scale_ptr,  # FP8: [num_kv_heads] float32
    qk_scale,  # softmax scale * log2(e)
    window,  # WINDOW: a row at position p sees keys p - window + 1 .. p
    softcap,  # SOFTCAP: scores (scale * q.k) become softcap * tanh(score / softcap)
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
    WINDOW: tl.constexpr,  # a sliding-window layer (Mistral, Gemma's local layers)
    SOFTCAP: tl.constexpr,  # soft-capped scores (Gemma 2)
    FP8: tl.constexpr,  # an fp8 cache: K/V are read in q's dtype (exact) and scaled
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
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
    v_scale = 1.0
    if FP8:  # one scale per KV head (this program's): on the scores, and on the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    # Keys this tile needs: 0 (with a window: the first row's reach) .. the last row's
    # position; this split takes an even share of tiles.
    kv_end = num_cached + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    kv_begin = 0
    if WINDOW:
        kv_begin = tl.maximum(num_cached + tile_q0 - window + 1, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, TILE_N), NUM_SPLITS)
    kv_lo = kv_begin + split * tiles_per_split * TILE_N
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
        elif FP8:  # every fp8 value is exact in fp16 and bf16
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if SOFTCAP:  # on the score itself (log2 units back and forth); tanh by exp2
            capped = s * (0.6931471805599453 / softcap)
            s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.math.exp2(capped * 2.8853900817779268) + 1.0))
        visible = (keys[None, :] <= row_pos[:, None]) & key_ok[None, :]
        if WINDOW:
            visible = visible & (keys[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * v_scale
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


@triton.jit
def merge_splits_kernel(
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
