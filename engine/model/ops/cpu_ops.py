"""CPU tuning, in one place: the ops object that runs a float32 model on the C++
kernels of kernels/cpu_ext.py, the choice of who does prefill's matmuls, and the
process settings a CPU engine wants.

`CpuKernelOps` implements engine/model/ops/torch_ops.py's TorchOps with:
* RMSNorm and residual add + RMSNorm as fused float32 ops (kernels/csrc/fused_ops.cpp);
* few-row matmuls (decode steps, the LM head) by kernels/csrc/small_gemm.cpp on a
  packed copy of each weight, the MLP's gate/up with SwiGLU's gating applied as it
  goes (packed_swiglu: the [T, 2 * intermediate] product is never written out);
* many-row matmuls (prefill) by MKL on the plain layout, or by the packed kernel too
  when `large_matmuls` says so (EngineConfig.large_matmuls; kernels.cpu_ext.matmul_choice);
* RoPE and the K/V store as one fused op where the attention backend reads K/V back
  from the cache (its C++ kernels); TorchOps' RoPE and store otherwise.

Weights only the packed kernels read are freed: the packed copy is then the only one.
What the kernels do not cover (another activation than SiLU, Gemma's norm offset in a
dtype other than float32) falls through to TorchOps, so any model runs.

The runner's choose_ops (engine/model/device.py) picks it where `cpu_kernel_ops` gives
one.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.model.ops.torch_ops import TorchOps

if TYPE_CHECKING:
    from engine.model.ops.attention import AttentionBackend
    from engine.config import EngineConfig
    from engine.model.transformer import Attention, FeedForward, Linear, RMSNorm, StepContext, Transformer
    from kernels.cpu_ext import MatmulChoice

# Up to this many rows, kernels/csrc/small_gemm.cpp beats MKL on any x86 CPU (on Intel:
# 1.4x at 64 rows, 0.9x at 128: python -m benchmarks.bench_cpu gemm); above it, matmuls go
# to MKL unless the packed kernel does every matmul (large_matmuls, on AMD: ~2x).
PACKED_MAX_ROWS = 96
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


class CpuKernelOps(TorchOps):
    name = "cpu-kernels"

    def __init__(self, kernels: object, choice: "MatmulChoice", native_attention: bool) -> None:
        self.k = kernels  # torch.ops.kvops
        self.choice = choice
        # the packed kernel takes matmuls of up to max_rows rows (None: all of them)
        self.max_rows: int | None = None if choice.packed else PACKED_MAX_ROWS
        self.native_attention = native_attention  # the backend reads K/V from the cache
        self.packed: dict[int, torch.Tensor] = {}  # id(Linear) -> its packed weight
        self.packed_gate_up: dict[int, torch.Tensor] = {}  # id(FeedForward) -> packed, SiLU
        self.lm_head_packed: torch.Tensor | None = None

    def describe(self) -> str:
        who = "the packed kernel" if self.choice.packed else "MKL"
        if self.choice.source != "measured":
            return f"on; prefill matmuls by {who} ({self.choice.source})"
        return (f"on; prefill matmuls by {who} (packed {self.choice.packed_gflops:.0f} vs MKL "
                f"{self.choice.mkl_gflops:.0f} GFLOP/s, measured)")

    def prepare(self, model: "Transformer") -> None:
        # what it packs, told by their parts (the layers' module imports this package):
        # a gated MLP (FeedForward: w_gate_up) and every Linear (weight_t)
        linears = []
        for module in model.modules():
            if hasattr(module, "w_gate_up") and module.activation == "silu":
                self.packed_gate_up[id(module)] = self.k.pack_gate_up(
                    module.w_gate_up.weight_t.detach(), module.intermediate_size)
            elif hasattr(module, "weight_t") and hasattr(module, "drop_plain_weight"):
                self.packed[id(module)] = self.k.pack_weight(module.weight_t.detach())
                linears.append(module)
        if self.max_rows is None:  # the packed kernels take every matmul: free the plain copies
            for module in linears:
                module.drop_plain_weight()
        self.lm_head_packed = self.k.pack_weight(model.lm_head.weight.detach().t().contiguous())
        if not model.args.tie_word_embeddings:  # (tied, it is the embedding table too)
            model.lm_head.weight = torch.nn.Parameter(
                model.lm_head.weight.new_empty(0, model.args.dim), requires_grad=False)

    def own_bytes(self) -> int:
        tensors = [*self.packed.values(), *self.packed_gate_up.values(), self.lm_head_packed]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _takes(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.shape[0] <= self.max_rows

    def rope_rows(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.native_attention:  # rope_store_kv takes (cos, sin) pairs: [T, D / 2, 2]
            return torch.view_as_real(table[positions]).contiguous()
        return super().rope_rows(table, positions)

    def linear(self, x: torch.Tensor, layer: "Linear") -> torch.Tensor:
        if self._takes(x):
            return self.k.packed_linear(x, self.packed[id(layer)], layer.out_features, layer.bias)
        return super().linear(x, layer)

    def gate_up_act(self, x: torch.Tensor, ffn: "FeedForward") -> torch.Tensor:
        packed = self.packed_gate_up.get(id(ffn))
        if packed is None:  # not SiLU
            return super().gate_up_act(x, ffn)
        if self._takes(x):
            return self.k.packed_swiglu(x, packed, ffn.intermediate_size, ffn.w_gate_up.bias)
        return self.k.silu_mul(self.linear(x, ffn.w_gate_up))

    def rms_norm(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        if norm.offset or x.dim() != 2:
            return super().rms_norm(x, norm)
        return self.k.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        if norm.offset:
            return super().add_rms_norm(h, delta, norm)
        return self.k.add_rms_norm(h, delta, norm.weight, norm.eps)

    def attention(self, qkv: torch.Tensor, attn: "Attention", ctx: "StepContext",
                  layer_idx: int) -> torch.Tensor:
        if not self.native_attention:
            return super().attention(qkv, attn, ctx, layer_idx)
        T, H = qkv.shape[0], attn.n_heads
        kv_layer, plan = ctx.kv_cache[attn.kv_slot], ctx.plans[attn.kv_group]
        q = self.k.rope_store_kv(qkv, ctx.rope[attn.rope_index], kv_layer, plan.slot_mapping,
                                 H, attn.n_kv_heads)  # [T, H, D], k and v in the cache
        o = ctx.attention.forward(q, None, None, kv_layer, plan, attn.scale,
                                  window=attn.window, softcap=attn.softcap)
        return o.reshape(T, H * attn.head_dim)

    def lm_head(self, x: torch.Tensor, model: "Transformer") -> torch.Tensor:
        return self.k.packed_linear(x, self.lm_head_packed, model.vocab_rows, None)


def cpu_kernel_ops(config: "EngineConfig", device: torch.device, dtype: torch.dtype,
                   backend: "AttentionBackend") -> CpuKernelOps | None:
    """CpuKernelOps for float32 on a CPU where the kernels build and config.cpu_kernels
    asks (cpu_ext.wanted) (config.large_matmuls deciding prefill's matmuls); None otherwise."""
    from kernels import cpu_ext

    if not cpu_ext.wanted(config.cpu_kernels) or not cpu_ext.usable_for(device, dtype):
        return None
    return CpuKernelOps(cpu_ext.ops(), cpu_ext.matmul_choice(config.large_matmuls),
                        native_attention=getattr(backend, "native", False))


def tune_process() -> None:
    """glibc hands large freed blocks back to the OS and page-faults fresh ones in on
    the next allocation: about 1 GB of page faults per 2048-token prefill step on the
    default model, a fifth of its time. Keep freed memory in the heap for reuse instead
    (a process-wide malloc setting; a no-op where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # serve big blocks from the heap...
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31)  # ...and do not give the heap back
    except (OSError, AttributeError):
        pass
