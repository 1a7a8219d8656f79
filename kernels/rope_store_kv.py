"""rope_store_kv: RoPE on a step's queries and keys, and the new K/V into the paged
cache, in one launch (one program per token).

It replaces, on the Triton path, the model's torch RoPE (engine/model/ops/torch_ops.py apply_rope,
pairs interleaved: d = 2i, 2i + 1, rotated in float32 and cast back) followed by
kernels.reshape_and_cache; the two together are its reference. K is stored rotated,
V as it is; an fp8 cache stores each divided by its head's scale and rounded as torch's
cast rounds (as reshape_and_cache does).
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels._triton import load_kernels, next_power_of_2
from kernels.fp8 import FP8_DTYPES, is_fp8
from kernels.reshape_and_cache import check_kv_scales

_OP = "rope_store_kv"
_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
_FP8_KIND = {FP8_DTYPES["fp8_e4m3"]: 1, FP8_DTYPES["fp8_e5m2"]: 2}


def rope_store_kv(qkv: torch.Tensor, cos_sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k of qkv, store k and v, return q.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], last dimension
        contiguous: q's heads, then k's, then v's.
    cos_sin: [num_tokens, head_dim // 2, 2] float32, contiguous: each token's (cos, sin)
        per rotary pair (torch.view_as_real of the model's complex table rows).
    key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim],
        qkv's dtype or fp8 (then k_scale and v_scale: [num_kv_heads] float32).
    slot_mapping: [num_tokens] int32/int64; a negative slot is padding (not stored), as
        is a slot past the cache's end.
    Returns the rotated queries, a new [num_tokens, num_heads, head_dim] tensor.
    """
    checks.check_ndim(_OP, "qkv", qkv, 2, "[num_tokens, (H + 2 Hkv) * head_dim]")
    T = qkv.shape[0]
    checks.check_dtype(_OP, "qkv", qkv, checks.ATTENTION_DTYPES)
    checks.check_last_dim_contiguous(_OP, "qkv", qkv)
    checks.check_ndim(_OP, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "key_cache", key_cache, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "value_cache", value_cache, _CACHE_LAYOUT)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"{_OP}: value_cache {tuple(value_cache.shape)} {value_cache.dtype} "
                         f"differs from key_cache {tuple(key_cache.shape)} {key_cache.dtype}")
    head_dim = key_cache.shape[3]
    if key_cache.shape[2] != num_kv_heads:
        raise ValueError(f"{_OP}: key_cache has {key_cache.shape[2]} kv heads, not {num_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"{_OP}: head_dim {head_dim} is odd; rotary pairs need an even one")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"{_OP}: qkv has {qkv.shape[1]} columns, not (num_heads + 2 * "
                         f"num_kv_heads) * head_dim = {(num_heads + 2 * num_kv_heads) * head_dim}")
    checks.check_ndim(_OP, "cos_sin", cos_sin, 3, "[num_tokens, head_dim // 2, 2]")
    if tuple(cos_sin.shape) != (T, head_dim // 2, 2):
        raise ValueError(f"{_OP}: cos_sin shape {tuple(cos_sin.shape)} != {(T, head_dim // 2, 2)}")
    checks.check_dtype(_OP, "cos_sin", cos_sin, (torch.float32,))
    checks.check_contiguous(_OP, "cos_sin", cos_sin, "[num_tokens, head_dim // 2, 2]")
    checks.check_ndim(_OP, "slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.check_dim_size(_OP, "slot_mapping", slot_mapping, 0, T, "qkv.shape[0] (num_tokens)")
    checks.check_dtype(_OP, "slot_mapping", slot_mapping, checks.INDEX_DTYPES)
    fp8 = is_fp8(key_cache.dtype)
    if fp8:
        check_kv_scales(_OP, num_kv_heads, key_cache.device, k_scale, v_scale)
    elif key_cache.dtype != qkv.dtype:
        raise ValueError(f"{_OP}: the cache is {key_cache.dtype}, qkv {qkv.dtype}; they must "
                         "match (or the cache be fp8)")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{_OP}: k_scale/v_scale are for an fp8 cache; this one is {key_cache.dtype}")
    checks.check_same_device(_OP, ("qkv", "cos_sin", "key_cache", "value_cache", "slot_mapping"),
                             (qkv, cos_sin, key_cache, value_cache, slot_mapping))
    checks.check_triton_device(_OP, qkv)
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    scales = (k_scale, v_scale) if fp8 else (slot_mapping, slot_mapping)
    kernel = load_kernels("kernels.rope_store_kv_kernel").rope_store_kv_kernel
    kernel[(T,)](
        q, qkv, cos_sin, key_cache, value_cache, slot_mapping, *scales,
        key_cache.shape[0] * key_cache.shape[1], qkv.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        QK_PAD=next_power_of_2(num_heads + num_kv_heads), KV_PAD=next_power_of_2(num_kv_heads),
        HALF_PAD=next_power_of_2(max(head_dim // 2, 1)), DIM_PAD=next_power_of_2(head_dim),
        FP8=_FP8_KIND.get(key_cache.dtype, 0),
    )
    return q
