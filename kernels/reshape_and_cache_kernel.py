"""Triton kernel for reshape_and_cache (launcher and checks: kernels/reshape_and_cache.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl


@triton.jit
def _round_to_fp8_grid(x, TOP: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 x -> the nearest value of an fp8 format (ties to even), clamped to +-TOP
    first: the value the cast to fp8 then writes exactly. Rounding here instead of in
    the cast keeps the interpreter (whose fp8 cast mis-rounds a carry into the exponent)
    and the GPU bit for bit equal to torch's cast."""
    # (NaN stays NaN, as torch's clamp keeps it)
    x = tl.minimum(tl.maximum(x, -TOP, propagate_nan=tl.PropagateNan.ALL), TOP,
                   propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # subnormals: the smallest step
    step = ((exp - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exp - mantissa)
    # |x| + 1.5 * 2^23 * step is rounded (to even) to a multiple of step by the fp32 add
    magic = step * 12582912.0
    a = tl.abs(x)
    r = (a + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign back, -0.0 included


@triton.jit
def _nan_kept(q, x):
    """q, the fp8 cast of x, with NaN where x is NaN (0x7f: NaN in both formats), as
    torch's cast gives (the interpreter's e4m3 cast does not)."""
    bits = tl.where(x != x, 0x7F, q.to(tl.int8, bitcast=True))
    return bits.to(q.dtype, bitcast=True)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache_ptr,  # same shape as key_cache
    slot_mapping_ptr,  # [num_tokens], int32 or int64
    k_scale_ptr,  # FP8: [num_kv_heads] float32 (K is stored as k / scale)
    v_scale_ptr,  # FP8: [num_kv_heads] float32
    num_slots,  # num_blocks * block_size
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    FP8: tl.constexpr,  # 0: copy the bits; 1: quantise to e4m3; 2: to e5m2
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
    v = tl.load(value_ptr + value_offs, mask=mask)
    if FP8:
        head_ok = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0)
        # correctly rounded division (a GPU's `/` on fp32 is not), as torch's
        k = tl.math.div_rn(k.to(tl.float32), tl.broadcast_to(k_scale[:, None], k.shape))
        v = tl.math.div_rn(v.to(tl.float32), tl.broadcast_to(v_scale[:, None], v.shape))
        if FP8 == 1:
            k = _nan_kept(_round_to_fp8_grid(k, 448.0, 3, -6).to(tl.float8e4nv), k)
            v = _nan_kept(_round_to_fp8_grid(v, 448.0, 3, -6).to(tl.float8e4nv), v)
        else:
            k = _nan_kept(_round_to_fp8_grid(k, 57344.0, 2, -14).to(tl.float8e5), k)
            v = _nan_kept(_round_to_fp8_grid(v, 57344.0, 2, -14).to(tl.float8e5), v)
    tl.store(key_cache_ptr + cache_offs, k, mask=mask)
    tl.store(value_cache_ptr + cache_offs, v, mask=mask)
