"""Attention backends: how a layer stores its new K/V and attends through the block
tables. The model's ops call `backend.forward(q, k, v, kv_layer, plan, scale)` once per
layer (k and v None when a fused op of theirs already stored them); the runner calls
`backend.plan(batch)` once per step.

* "torch": kernels/cpu_attention.py (vectorised torch). The CPU path and the fallback;
  in float32 on a CPU its attention runs in the C++ kernels of kernels/cpu_ext.py
  (paged_decode_attention, paged_prefill_attention) when they build here.
* "triton": kernels.reshape_and_cache + kernels.paged_attention (CUDA, or the Triton
  interpreter under TRITON_INTERPRET=1).
* "auto": triton on CUDA, torch on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import EngineError


class AttentionBackendError(EngineError):
    """The requested attention backend cannot run here."""


@dataclass(slots=True)
class DeviceTables:
    """A step's tables already on the device (engine/model/step_buffers.py), as the
    Triton kernels read them, with the host-side bounds their launch is planned by."""
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_seq_len: int  # a bound on seq_lens (a CUDA graph's: max_model_len)
    max_query_len: int


@dataclass(slots=True)
class AttentionBatch:
    """One step's varlen batch, as both host lists (for planning without a device sync)
    and device tensors (for kernels)."""
    block_size: int
    block_tables: list[list[int]]  # per sequence, the blocks its context occupies
    seq_lens: list[int]  # context length per sequence, including its new tokens
    query_start_loc: list[int]  # [num_seqs + 1]: sequence s owns rows [qsl[s], qsl[s+1])
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: where each new K/V goes
    # the same tables on the device, where the step's input batch keeps them (None: a
    # backend that needs them builds them from the lists)
    device: DeviceTables | None = None


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: AttentionBatch) -> object:
        """Per-step bookkeeping shared by every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_layer: torch.Tensor, plan: object, scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Store k/v through the plan's slot mapping (unless None: the caller stored
        them), then attend: q [T, H, D], k/v [T, Hkv, D], kv_layer [2, num_blocks,
        block_size, Hkv, D] -> [T, H, D]. window: the layer's sliding window (a query
        sees itself and window - 1 tokens back; None: all); softcap: scores become
        softcap * tanh(score / softcap) (Gemma 2); kv_scale: an fp8 cache's [2, Hkv]
        float32 scales of this layer's K and V (kernels/fp8.py)."""


class TorchAttention:
    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32,
                 cpu_kernels: bool = True) -> None:
        from kernels import cpu_ext

        self.device = device
        # the C++ attention kernels, where they build and the engine wants them
        self.native = cpu_kernels and cpu_ext.usable_for(device, dtype)

    def plan(self, batch: AttentionBatch) -> "TorchPlan":
        from kernels.cpu_attention import plan_attention

        return TorchPlan(batch.slot_mapping, plan_attention(
            batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.block_size,
            self.device, native=self.native), batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_layer: torch.Tensor, plan: "TorchPlan", scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] or None; kv_layer: [2, num_blocks, block_size,
        Hkv, D]. An fp8 cache (kv_scale): k and v quantised into it (torch's cast), and
        every read of it, the new tokens' included, dequantised (as the Triton kernels
        do)."""
        from kernels._checks import as_bits
        from kernels.cpu_attention import paged_attention
        from kernels.fp8 import quantize

        scales = None if kv_scale is None else (kv_scale[0], kv_scale[1])
        if k is not None:
            num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
            new = torch.stack((k, v)) if scales is None else torch.stack(
                (quantize(k, scales[0], kv_layer.dtype), quantize(v, scales[1], kv_layer.dtype)))
            # One scatter for K and V: [2, num_slots, Hkv * D] <- [2, T, Hkv * D], as bits
            # (index_copy_ has no fp8 kernel on CPU)
            slots = as_bits(kv_layer).view(2, num_blocks * block_size, -1)
            slots.index_copy_(1, plan.slot_mapping, as_bits(new).view(2, k.shape[0], -1))
        if window or softcap:
            return _windowed(q, kv_layer, plan.batch, scale, window, softcap, scales)
        if k is None or scales is not None:
            # already in the cache (kvops::rope_store_kv put them there); or fp8: read back
            return paged_attention(q, kv_layer[0], kv_layer[1], plan.cpu, scale,
                                   kv_scales=scales)
        return paged_attention(q, kv_layer[0], kv_layer[1], plan.cpu, scale,
                               new_key=k, new_value=v)


@dataclass(slots=True)
class TorchPlan:
    slot_mapping: torch.Tensor  # [T] int64
    cpu: object  # kernels.cpu_attention.CpuAttentionPlan
    batch: AttentionBatch  # for the layers with a window or soft-capped scores


def _windowed(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch, scale: float,
              window: int | None, softcap: float | None,
              kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Layers with a sliding window or soft-capped scores on the torch backend (the C++
    kernels do not implement them; the Triton kernel does)."""
    from kernels.cpu_attention import windowed_attention

    return windowed_attention(q, kv_layer[0], kv_layer[1], batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, scale, window, softcap, kv_scales=kv_scales)


class TritonAttention:
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        import kernels

        self.device = device
        self._reshape_and_cache = kernels.reshape_and_cache
        self._paged_attention = kernels.paged_attention

    def plan(self, batch: AttentionBatch) -> "TritonPlan":
        d = batch.device
        if d is not None:  # (the step buffers': no per-sequence work here)
            return TritonPlan(batch.slot_mapping, d.block_tables, d.seq_lens,
                              d.query_start_loc, d.max_seq_len, d.max_query_len)
        max_blocks = max(len(t) for t in batch.block_tables)
        tables = torch.zeros(len(batch.block_tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(batch.block_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        query_lens = [b - a for a, b in zip(batch.query_start_loc, batch.query_start_loc[1:])]
        return TritonPlan(
            slot_mapping=batch.slot_mapping,
            block_tables=tables.to(self.device, non_blocking=True),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32).to(self.device, non_blocking=True),
            query_start_loc=torch.tensor(batch.query_start_loc, dtype=torch.int32).to(
                self.device, non_blocking=True),
            max_seq_len=max(batch.seq_lens), max_query_len=max(query_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_layer: torch.Tensor, plan: "TritonPlan", scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        if k is not None:
            self._reshape_and_cache(k, v, kv_layer[0], kv_layer[1], plan.slot_mapping,
                                    k_scale, v_scale)
        return self._paged_attention(q, kv_layer[0], kv_layer[1], plan.block_tables,
                                     plan.seq_lens, plan.query_start_loc, scale,
                                     max_seq_len=plan.max_seq_len,
                                     max_query_len=plan.max_query_len, window=window,
                                     softcap=softcap, k_scale=k_scale, v_scale=v_scale)


@dataclass(slots=True)
class TritonPlan:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_seq_len: int
    max_query_len: int


def make_attention_backend(name: str, device: torch.device,
                           dtype: torch.dtype = torch.float32,
                           cpu_kernels: bool = True) -> AttentionBackend:
    """name: "auto" | "torch" | "triton"; dtype: the KV cache's; cpu_kernels: the torch
    backend may use the C++ CPU kernels (EngineConfig.cpu_kernels, resolved by
    kernels.cpu_ext.wanted)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return TorchAttention(device, dtype, cpu_kernels)
    if name == "triton":
        if not _triton_available():
            raise AttentionBackendError(
                "attention_backend='triton' needs the triton package; install it or use "
                "attention_backend='torch'")
        if device.type != "cuda" and not _triton_interpreting():
            raise AttentionBackendError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for "
                "the slow CPU interpreter); use attention_backend='torch' on CPU")
        return TritonAttention(device)
    raise AttentionBackendError(f"unknown attention backend {name!r}")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_interpreting() -> bool:
    from kernels._triton import interpreting

    return interpreting()
