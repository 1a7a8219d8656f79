"""copy_blocks: copy-on-write inside one KV pool.

For each (src, dst) pair, every layer's K and V block src is copied to block dst, in
one launch: program (pair, layer * 2 + kv) copies one block of one plane.
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels._triton import load_kernels

_OP = "copy_blocks"
_KV_CACHE_LAYOUT = "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"
_CHUNK = 1024  # elements moved per inner iteration


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks src -> dst for every layer's K and V of `kv_cache`, in place.

    kv_cache: contiguous [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim],
        any dtype.
    block_mapping: [n, 2] int64 (or int32) of (src, dst) block ids, on any device.
        Checked on the host (one small device-to-host copy): ids in range, no dst
        repeated, and no block both a source and a destination, since pairs run in
        parallel and their order is not defined.
    """
    checks.check_ndim(_OP, "kv_cache", kv_cache, 6, _KV_CACHE_LAYOUT)
    checks.check_dim_size(_OP, "kv_cache", kv_cache, 1, 2, "2 (K and V)")
    checks.check_contiguous(_OP, "kv_cache", kv_cache, _KV_CACHE_LAYOUT)
    num_blocks = kv_cache.shape[2]
    mapping = checks.check_block_mapping(_OP, block_mapping, num_blocks, num_blocks)
    if mapping.shape[0] == 0:
        return
    both = set(mapping[:, 0].tolist()) & set(mapping[:, 1].tolist())
    if both:
        raise ValueError(
            f"{_OP}: blocks {sorted(both)} are both a source and a destination; pairs run in "
            "parallel, so split the mapping into two calls"
        )
    checks.check_triton_device(_OP, kv_cache)
    mapping = mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    num_layers = kv_cache.shape[0]
    block_numel = kv_cache[0, 0, 0].numel()
    kernel = load_kernels("kernels.copy_blocks_kernel").copy_blocks_kernel
    kernel[(mapping.shape[0], num_layers * 2)](
        checks.as_bits(kv_cache), mapping, num_blocks * block_numel, block_numel, CHUNK=_CHUNK,
    )
