"""reshape_and_cache: write the new tokens' K and V into the paged cache.

Token i goes to slot `slot_mapping[i]` = block_id * block_size + offset, i.e. to
`key_cache[slot // block_size, slot % block_size]`. A negative slot marks a padding
token and is skipped. One program per token copies all of its heads.
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels.fp8 import FP8_DTYPES, is_fp8
from kernels._triton import load_kernels, next_power_of_2

_OP = "reshape_and_cache"
_KV_LAYOUT = "[num_tokens, num_kv_heads, head_dim]"
_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` rows into `key_cache`/`value_cache` at `slot_mapping`, in place.

    key, value: [num_tokens, num_kv_heads, head_dim], last dimension contiguous (views
        into a fused qkv tensor are fine).
    key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim],
        same dtype as key/value (any dtype: the kernel copies bits), or fp8
        (float8_e4m3fn, float8_e5m2): the rows are stored as key / k_scale and
        value / v_scale, clamped to the format's range and rounded to nearest even,
        bit for bit as kernels.fp8.quantize (torch's cast) does.
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache only.
    slot_mapping: [num_tokens] int32/int64; slot = block_id * block_size + offset;
        slot < 0 is padding and is skipped. Slots >= num_blocks * block_size are also
        skipped (never written out of bounds); the torch reference raises on them.
    """
    fp8 = is_fp8(key_cache.dtype)
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    if fp8:
        _check_scales(key, k_scale, v_scale)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{_OP}: k_scale/v_scale are for an fp8 cache; this one is "
                         f"{key_cache.dtype}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if fp8:  # the values themselves: the kernel quantises them
        args = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:  # bits: a copy
        args = (checks.as_bits(key), checks.as_bits(value), checks.as_bits(key_cache),
                checks.as_bits(value_cache), slot_mapping, slot_mapping, slot_mapping)
    kernel = load_kernels("kernels.reshape_and_cache_kernel").reshape_and_cache_kernel
    kernel[(num_tokens,)](
        *args,
        num_slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        DIM_PAD=next_power_of_2(head_dim),
        FP8=_FP8_KIND.get(key_cache.dtype, 0),
    )


_FP8_KIND = {FP8_DTYPES["fp8_e4m3"]: 1, FP8_DTYPES["fp8_e5m2"]: 2}


def _check_scales(key: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> None:
    checks.check_dtype(_OP, "key", key, checks.ATTENTION_DTYPES)
    check_kv_scales(_OP, key.shape[1], key.device, k_scale, v_scale)


def check_kv_scales(op: str, num_kv_heads: int, device: torch.device,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An fp8 cache's scales: [num_kv_heads] float32 each, on the cache's device."""
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"{op}: an fp8 cache needs {name} ([num_kv_heads] float32)")
        checks.check_ndim(op, name, t, 1, "[num_kv_heads]")
        checks.check_dim_size(op, name, t, 0, num_kv_heads, "num_kv_heads")
        checks.check_dtype(op, name, t, (torch.float32,))
        checks.check_contiguous(op, name, t, "[num_kv_heads]")
        if t.device != device:
            raise ValueError(f"{op}: {name} must be on {device}, got {t.device}")


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    checks.check_ndim(_OP, "key", key, 3, _KV_LAYOUT)
    checks.check_ndim(_OP, "value", value, 3, _KV_LAYOUT)
    checks.check_ndim(_OP, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "value_cache", value_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "slot_mapping", slot_mapping, 1, "[num_tokens]")
    if value.shape != key.shape:
        raise ValueError(f"{_OP}: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{_OP}: value_cache shape {tuple(value_cache.shape)} != "
            f"key_cache shape {tuple(key_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    checks.check_dim_size(_OP, "key_cache", key_cache, 2, num_kv_heads, "key.shape[1] (num_kv_heads)")
    checks.check_dim_size(_OP, "key_cache", key_cache, 3, head_dim, "key.shape[2] (head_dim)")
    checks.check_dim_size(_OP, "slot_mapping", slot_mapping, 0, num_tokens, "key.shape[0] (num_tokens)")
    if is_fp8(key_cache.dtype):
        checks.check_same_dtype(_OP, ("key", "value"), (key, value))
        checks.check_same_dtype(_OP, ("key_cache", "value_cache"), (key_cache, value_cache))
    else:
        checks.check_same_dtype(_OP, ("key", "value", "key_cache", "value_cache"),
                                (key, value, key_cache, value_cache))
    checks.check_dtype(_OP, "slot_mapping", slot_mapping, checks.INDEX_DTYPES)
    checks.check_last_dim_contiguous(_OP, "key", key)
    checks.check_last_dim_contiguous(_OP, "value", value)
    checks.check_contiguous(_OP, "key_cache", key_cache, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "value_cache", value_cache, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "slot_mapping", slot_mapping, "[num_tokens]")
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    tensors = (key, value, key_cache, value_cache, slot_mapping)
    checks.check_same_device(_OP, names, tensors)
    checks.check_triton_device(_OP, key)
