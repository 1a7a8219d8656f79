"""Paged-KV kernels: Triton kernels with checked launchers, and their torch references.

Importing this package does not need Triton; launching a Triton kernel does (and a
CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter). Cache layout per layer:
[num_blocks, block_size, num_kv_heads, head_dim] for K and for V; the engine's
kv_cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from kernels.copy_blocks import copy_blocks
from kernels.fused_moe import fused_moe, fused_moe_torch
from kernels.paged_attention import paged_attention
from kernels.reference import (
    copy_blocks_ref,
    fused_moe_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    swap_blocks_ref,
)
from kernels.reshape_and_cache import reshape_and_cache
from kernels.swap import swap_blocks

__all__ = [
    "copy_blocks",
    "copy_blocks_ref",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_torch",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "swap_blocks",
    "swap_blocks_ref",
]
