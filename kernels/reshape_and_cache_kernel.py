"""Triton kernel for reshape_and_cache (launcher and checks: kernels/reshape_and_cache.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache_ptr,  # same shape as key_cache
    slot_mapping_ptr,  # [num_tokens], int32 or int64
    num_slots,  # num_blocks * block_size
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # Padding (slot < 0) is skipped. A slot past the cache end is skipped too, so a
    # bad slot mapping cannot write outside the cache; the reference raises on it.
    if (slot < 0) | (slot >= num_slots):
        return

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key_offs = tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :]
    value_offs = tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :]
    # The cache is contiguous, so a slot's rows start at slot * heads * dim.
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]

    k = tl.load(key_ptr + key_offs, mask=mask)
    tl.store(key_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(value_ptr + value_offs, mask=mask)
    tl.store(value_cache_ptr + cache_offs, v, mask=mask)
