"""Triton kernel for copy_blocks (launcher and checks: kernels/copy_blocks.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(
    cache_ptr,  # kv_cache viewed as integers of the same width, contiguous
    block_mapping_ptr,  # [num_pairs, 2] int64, contiguous
    plane_numel,  # num_blocks * block_numel: one layer's K (or V)
    block_numel,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    src_base = cache_ptr + plane * plane_numel + src * block_numel
    dst_base = cache_ptr + plane * plane_numel + dst * block_numel
    for start in range(0, block_numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < block_numel
        tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)
