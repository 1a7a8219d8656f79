"""FP8 K/V: the formats, and quantisation in plain torch (the CPU path and the reference
the Triton kernels are tested against).

A cache of dtype float8_e4m3fn or float8_e5m2 holds x / scale rounded to the nearest
value of the format (ties to even), clamped to the format's largest finite value
first, as vLLM's fp8 KV cache does; reading it back multiplies by the scale. Scales
are float32, one per KV head of a layer ([num_kv_heads]: a per-tensor scale is the
same value on every head), one set for K and one for V.

Movement never converts: copies, swaps, the disk tier and migration move the bytes.
"""
from __future__ import annotations

import torch

# EngineConfig.kv_cache_dtype -> the cache's torch dtype ("auto": the model's own)
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Per format: (its largest finite value, mantissa bits, the smallest normal exponent);
# the Triton kernel rounds on this grid itself (kernels/reshape_and_cache_kernel.py)
FP8_GRID = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_GRID


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V cache's dtype for EngineConfig.kv_cache_dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_DTYPES[kv_cache_dtype]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] -> dtype (fp8): x / scale, clamped, rounded.
    scale: [num_kv_heads] float32."""
    top = FP8_GRID[dtype][0]
    return (x.float() / scale[:, None]).clamp_(-top, top).to(dtype)


def dequantize(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [..., num_kv_heads, head_dim] (fp8) -> dtype: y * scale. scale: [num_kv_heads]."""
    return (y.float() * scale[:, None]).to(dtype)


def scales_for(amax: torch.Tensor, dtype: torch.dtype, headroom: float = 2.0) -> torch.Tensor:
    """Scales from the largest magnitudes seen (per head or per tensor): a power of two
    (so that dividing by it is exact) at which amax * headroom still fits the format.
    Zero (a head never written) gets 1."""
    top = FP8_GRID[dtype][0]
    wanted = (amax.float() * headroom / top).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(wanted))), 1.0)


# What an fp8 cache's scales are calibrated on at start-up (engine/model/fp8_scales.py):
# prose, a dialogue, code and numbers, so that K and V reach the sizes real prompts
# give them. Fixed: the same model gets the same scales at every start.
CALIBRATION_TEXT = """\
<|im_start|>system
You are a helpful assistant. Answer briefly and cite the section you used.<|im_end|>
<|im_start|>user
The river rose three metres overnight; the bridge at Kestrel Lane closed at 04:10 and
the ferry took 1,284 passengers instead. What changed for commuters, and why?<|im_end|>
<|im_start|>assistant
Commuters crossing at Kestrel Lane moved to the ferry (1,284 passengers) because the
bridge closed at 04:10 when the river rose three metres (section 2).<|im_end|>
<|im_start|>user
Write a Python function that merges two sorted lists.<|im_end|>
<|im_start|>assistant
def merge(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
<|im_end|>
Tables: 3.14159, 2.71828, 1.41421, 6.02214076e23, -273.15, 0x7f, 0b1011, 42%.
Le vent du nord soufflait sur la ville; die Straßen waren leer; el tren llegó tarde.
"""
