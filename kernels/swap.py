"""swap_blocks: move blocks between the device pool and the host pool.

Batched, not one copy per block: gather the source blocks into one contiguous buffer
(index_select on the source device), make one transfer, scatter them with
index_copy_ on the destination device. Plain torch; both pools have the kv_cache
layout and may differ only in their number of blocks.
"""

from __future__ import annotations

import torch

from kernels import _checks as checks

_OP = "swap_blocks"
_KV_CACHE_LAYOUT = "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"
_BLOCK_DIM = 2


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy every layer's K and V block src (of src_cache) to block dst (of dst_cache).

    src_cache, dst_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim],
        same dtype and same shape except num_blocks, on any devices (e.g. the GPU pool
        and a pinned host pool). A pinned host pool makes the transfer asynchronous
        with respect to the host; the destination is ready in stream order.
    block_mapping: [n, 2] int64/int32 of (src block, dst block), on any device;
        validated on the host (ids in range, no dst repeated).
    """
    for name, cache in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        checks.check_ndim(_OP, name, cache, 6, _KV_CACHE_LAYOUT)
        checks.check_dim_size(_OP, name, cache, 1, 2, "2 (K and V)")
    if src_cache.shape[:2] != dst_cache.shape[:2] or src_cache.shape[3:] != dst_cache.shape[3:]:
        raise ValueError(
            f"{_OP}: src_cache {tuple(src_cache.shape)} and dst_cache {tuple(dst_cache.shape)} "
            "must match in every dimension but num_blocks (dim 2)"
        )
    checks.check_same_dtype(_OP, ("src_cache", "dst_cache"), (src_cache, dst_cache))
    mapping = checks.check_block_mapping(_OP, block_mapping, src_cache.shape[_BLOCK_DIM],
                                         dst_cache.shape[_BLOCK_DIM])
    if mapping.shape[0] == 0:
        return

    # bits, not numbers: every dtype moves alike (index_copy_ has no fp8 kernel on CPU)
    src_cache, dst_cache = checks.as_bits(src_cache), checks.as_bits(dst_cache)
    src_ids = mapping[:, 0].to(device=src_cache.device, dtype=torch.int64)
    dst_ids = mapping[:, 1].to(device=dst_cache.device, dtype=torch.int64)
    # staged: [num_layers, 2, n, block_size, num_kv_heads, head_dim], contiguous
    staged = _transfer(src_cache, src_ids, dst_cache.device)
    dst_cache.index_copy_(_BLOCK_DIM, dst_ids, staged)


def _transfer(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_device: torch.device) -> torch.Tensor:
    """The selected blocks of every layer, gathered into one buffer and moved to dst_device
    in one copy. Host-side buffers are pinned when CUDA is involved, so the copy is a
    straight DMA (asynchronous for host-to-device)."""
    shape = list(src_cache.shape)
    shape[_BLOCK_DIM] = src_ids.numel()
    src_device = src_cache.device
    if src_device.type == "cpu" and dst_device.type == "cuda":
        staged = torch.empty(shape, dtype=src_cache.dtype, pin_memory=True)
        torch.index_select(src_cache, _BLOCK_DIM, src_ids, out=staged)
        return staged.to(dst_device, non_blocking=True)
    staged = src_cache.index_select(_BLOCK_DIM, src_ids)
    if src_device.type == "cuda" and dst_device.type == "cpu":
        host = torch.empty(shape, dtype=src_cache.dtype, pin_memory=True)
        host.copy_(staged)  # synchronous: index_copy_ on the host reads it right after
        return host
    return staged.to(dst_device)
