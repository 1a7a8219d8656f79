"""The KV pools' sizes and memory: the device pool (from num_gpu_blocks, or from the
memory left once the weights and a full-budget step's activations are counted) and the
host swap pool, each one tensor [slots, 2, num_blocks, block_size, kv heads, head dim]
(engine/kv/layout.py: a slot per layer, or per layer group)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError

DEFAULT_CPU_KV_BYTES = 512 * 1024 ** 2

# runs token sequences through the model against a scratch cache just big enough
ProfileForward = Callable[[list[list[int]]], None]


def device_blocks(config: EngineConfig, device: torch.device, block_bytes: int,
                  max_model_len: int, forward: ProfileForward,
                  decode_graphs: bool = False) -> int:
    """The device pool's blocks: on CUDA, what gpu_memory_utilization leaves after a
    profiled step (`forward`) and, with decode_graphs, the CUDA graphs' memory pool;
    on a CPU, kv_cache_memory_bytes or the default."""
    if device.type == "cuda":
        budget = _cuda_kv_budget(config, device, max_model_len, forward, decode_graphs)
        source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        source = ("kv_cache_memory_bytes" if config.kv_cache_memory_bytes
                  else "the CPU default")
    num_blocks = budget // block_bytes
    _log(f"kvops: KV pool from {source}: {budget / 1024 ** 2:.0f} MiB / "
         f"{block_bytes} B per block = {num_blocks} blocks")
    if num_blocks < 1:
        raise ModelLoadError(
            f"no memory left for the KV cache ({budget} B for {block_bytes} B blocks); "
            "lower max_num_batched_tokens, raise gpu_memory_utilization or set num_gpu_blocks")
    return int(num_blocks)


def host_blocks(num_gpu_blocks: int, device: torch.device, block_bytes: int) -> int:
    """Half the device pool, but on a GPU no more than a quarter of the host's free
    memory: the swap pool is pinned, and a big GPU's half would not fit."""
    blocks = num_gpu_blocks // 2
    if device.type == "cuda":
        free_host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        blocks = min(blocks, free_host // 4 // block_bytes)
    return int(blocks)


def allocate(block_shape: tuple[int, ...], num_gpu_blocks: int, num_cpu_blocks: int,
             kv_dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device pool and the host pool (pinned when the device is a GPU), zeroed;
    block_shape: one block's (slots, 2, block_size, kv heads, head dim)."""
    kv_cache = torch.zeros(with_blocks(block_shape, num_gpu_blocks), dtype=kv_dtype,
                           device=device)
    cpu_cache = torch.zeros(with_blocks(block_shape, num_cpu_blocks), dtype=kv_dtype,
                            pin_memory=device.type == "cuda")
    return kv_cache, cpu_cache


def with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    """(L, 2, bs, Hkv, D) -> (L, 2, num_blocks, bs, Hkv, D)."""
    return shape[:2] + (num_blocks,) + shape[2:]


def _cuda_kv_budget(config: EngineConfig, device: torch.device, max_model_len: int,
                    forward: ProfileForward, decode_graphs: bool) -> int:
    """Device memory the KV pool may take: gpu_memory_utilization of the device,
    minus what the weights and the activations of a full-budget step use (measured
    with one forward pass over max_num_batched_tokens tokens) and, with decode_graphs,
    the graphs' pool: the activations of the largest decode step (max_num_seqs
    sequences of one token, measured the same way), which the graphs hold apart from
    the eager steps' memory."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _profile_forward(config, device, max_model_len, forward)
    peak = torch.cuda.max_memory_allocated(device)
    graphs = 0
    if decode_graphs:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            forward([[0]] * config.max_num_seqs)
        torch.cuda.synchronize(device)
        graphs = torch.cuda.max_memory_allocated(device) - base
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    other = total - free - torch.cuda.memory_reserved(device)  # other processes
    budget = int(total * config.gpu_memory_utilization) - peak - graphs - max(other, 0)
    _log(f"kvops: device memory {total / 1024 ** 3:.1f} GiB x "
         f"{config.gpu_memory_utilization} - peak {peak / 1024 ** 3:.2f} GiB "
         f"(weights + activations) - {graphs / 1024 ** 3:.2f} GiB (decode graphs) - "
         f"{max(other, 0) / 1024 ** 3:.2f} GiB used elsewhere "
         f"= {budget / 1024 ** 3:.2f} GiB for KV")
    return budget


@torch.inference_mode()
def _profile_forward(config: EngineConfig, device: torch.device, max_model_len: int,
                     forward: ProfileForward) -> None:
    """One forward pass of max_num_batched_tokens tokens in sequences of at most
    max_model_len, against a scratch cache just big enough."""
    num_tokens = min(config.max_num_batched_tokens, max_model_len * config.max_num_seqs)
    seq_len = min(num_tokens, max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    forward([[0] * n for n in lens])
    torch.cuda.synchronize(device)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
