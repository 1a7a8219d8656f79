"""Triton kernel for rope_store_kv (launcher and checks: kernels/rope_store_kv.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl

from kernels.reshape_and_cache_kernel import _nan_kept, _round_to_fp8_grid
from kernels.rounding_kernel import round_to


@triton.jit
def _to_cache(x, scale, FP8: tl.constexpr):
    """Values in the model's dtype -> what the cache stores: the same values, or for an
    fp8 cache x / scale rounded as torch's cast rounds (kernels/reshape_and_cache_kernel.py)."""
    if FP8 == 1:
        y = tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(scale, x.shape))
        out = _nan_kept(_round_to_fp8_grid(y, 448.0, 3, -6).to(tl.float8e4nv), y)
    elif FP8 == 2:
        y = tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(scale, x.shape))
        out = _nan_kept(_round_to_fp8_grid(y, 57344.0, 2, -14).to(tl.float8e5), y)
    else:
        out = x
    return out


@triton.jit
def rope_store_kv_kernel(
    q_out_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM], contiguous: the rotated queries
    qkv_ptr,  # [num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM], rows stride_qkv apart
    cos_sin_ptr,  # [num_tokens, HEAD_DIM // 2, 2] float32, contiguous: each pair's (cos, sin)
    key_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM], contiguous
    value_cache_ptr,  # same shape as key_cache
    slot_mapping_ptr,  # [num_tokens] int32 or int64; < 0: padding, not stored
    k_scale_ptr,  # FP8: [NUM_KV_HEADS] float32 (else any pointer, unread)
    v_scale_ptr,
    num_slots,  # num_blocks * block_size
    stride_qkv,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_PAD: tl.constexpr,  # next power of two >= NUM_HEADS + NUM_KV_HEADS
    KV_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HALF_PAD: tl.constexpr,  # next power of two >= HEAD_DIM // 2
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    FP8: tl.constexpr,  # 0: the cache has the model's dtype; 1: e4m3; 2: e5m2
):
    tok = tl.program_id(0).to(tl.int64)
    # q and k heads together (adjacent in qkv), rotary pairs interleaved: d = 2i, 2i + 1
    heads = tl.arange(0, QK_PAD)
    pairs = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS + NUM_KV_HEADS) & (pairs[None, :] < HEAD_DIM // 2)
    at = qkv_ptr + tok * stride_qkv + heads[:, None] * HEAD_DIM + 2 * pairs[None, :]
    x0 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
    pair_ok = pairs < HEAD_DIM // 2
    cos = tl.load(cos_sin_ptr + tok * HEAD_DIM + 2 * pairs, mask=pair_ok, other=1.0)[None, :]
    sin = tl.load(cos_sin_ptr + tok * HEAD_DIM + 2 * pairs + 1, mask=pair_ok, other=0.0)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    r0 = round_to(x0 * cos - x1 * sin, dtype)  # (x0 + i x1)(cos + i sin), as torch's complex product
    r1 = round_to(x0 * sin + x1 * cos, dtype)
    q_mask = mask & (heads[:, None] < NUM_HEADS)
    q_at = q_out_ptr + tok * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + 2 * pairs[None, :]
    tl.store(q_at, r0, mask=q_mask)
    tl.store(q_at + 1, r1, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # Padding (slot < 0) is not stored, nor a slot past the cache's end
    if (slot >= 0) & (slot < num_slots):
        row = slot * (NUM_KV_HEADS * HEAD_DIM)
        kv_head = heads - NUM_HEADS  # k heads: NUM_HEADS.. of the q/k rows
        k_mask = mask & (heads[:, None] >= NUM_HEADS)
        if FP8 > 0:
            k_scale = tl.load(k_scale_ptr + kv_head, mask=(kv_head >= 0) & (kv_head < NUM_KV_HEADS),
                              other=1.0)[:, None]
        else:
            k_scale = 1.0
        k_at = key_cache_ptr + row + kv_head[:, None] * HEAD_DIM + 2 * pairs[None, :]
        tl.store(k_at, _to_cache(r0, k_scale, FP8), mask=k_mask)
        tl.store(k_at + 1, _to_cache(r1, k_scale, FP8), mask=k_mask)
        # v: copied (or quantised) as it is
        v_heads = tl.arange(0, KV_PAD)
        dims = tl.arange(0, DIM_PAD)
        v_mask = (v_heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        v_from = (qkv_ptr + tok * stride_qkv + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
                  + v_heads[:, None] * HEAD_DIM + dims[None, :])
        v = tl.load(v_from, mask=v_mask, other=0.0)
        if FP8 > 0:
            v_scale = tl.load(v_scale_ptr + v_heads, mask=v_heads < NUM_KV_HEADS, other=1.0)[:, None]
        else:
            v_scale = 1.0
        v_at = value_cache_ptr + row + v_heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(v_at, _to_cache(v, v_scale, FP8), mask=v_mask)
