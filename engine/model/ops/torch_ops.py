"""The model's arithmetic, behind one small object.

engine/model/transformer.py holds weights and says what a layer computes; an ops object says how:
every matmul, norm, activation, RoPE + K/V store and the attention call of a forward
pass goes through one. `TorchOps` (plain torch) is the default on every device and the
reference the others are tested against. The runner picks the implementation once,
at start-up (engine/model/device.py, choose_ops): engine/model/ops/cpu_ops.py's `CpuKernelOps`
(the C++ CPU kernels) for float32 on a CPU, engine/model/ops/triton_ops.py's `TritonOps` with the
Triton backend, TorchOps elsewhere; the attention call itself goes to the engine's
AttentionBackend (torch, C++ or Triton, engine/model/ops/attention.py).

An ops object may keep weights in its own layout (CpuKernelOps packs them for its
GEMM); `prepare(model)` does that once, after loading.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # (engine.model imports this module)
    from engine.model.transformer import (Attention, FeedForward, Linear, MoE, RMSNorm, StepContext,
                              Transformer)


class TorchOps:
    name = "torch"

    def prepare(self, model: "Transformer") -> None:
        """Called once with the loaded model: TorchOps reads the weights as they are."""

    def describe(self) -> str:
        return self.name

    def own_bytes(self) -> int:
        """Memory of the weights this ops object keeps in its own layout."""
        return 0

    # --- per step -----------------------------------------------------------------------
    def rope_rows(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This step's rotations from a model's table ([max_positions, D / 2] complex):
        [T, 1, D / 2] complex, what apply_rope takes."""
        return table[positions][:, None, :]

    # --- per layer ----------------------------------------------------------------------
    def linear(self, x: torch.Tensor, layer: "Linear") -> torch.Tensor:
        """x [T, in] -> [T, out]: x @ weight_t (+ bias)."""
        if layer.bias is None:
            return torch.mm(x, layer.weight_t)
        return torch.addmm(layer.bias, x, layer.weight_t)

    def gate_up_act(self, x: torch.Tensor, ffn: "FeedForward") -> torch.Tensor:
        """act(x @ gate) * (x @ up): [T, dim] -> [T, intermediate]."""
        gate, up = self.linear(x, ffn.w_gate_up).split(ffn.intermediate_size, dim=-1)
        return activation(ffn.activation, gate).mul_(up)

    def rms_norm(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        return rms_norm(x, norm.weight, norm.eps, norm.offset)

    def route(self, x: torch.Tensor, moe: "MoE") -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts: (weights [T, k] float32, ids [T, k] int64), the top k of
        the router's softmax (in float32), renormalised to sum to 1 if the model does."""
        probs = torch.softmax(self.linear(x, moe.router).float(), dim=-1)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe(self, x: torch.Tensor, moe: "MoE") -> torch.Tensor:
        """The experts' MLPs, grouped by expert (one pair of matmuls per expert that
        has tokens): [T, dim] -> [T, dim]."""
        from kernels.fused_moe import fused_moe_torch

        weights, ids = self.route(x, moe)
        return fused_moe_torch(x, moe.experts_gate_up, moe.experts_down, weights, ids,
                               moe.activation)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """h += delta (h is the forward pass's own residual stream), then norm(h)."""
        return self.rms_norm(h.add_(delta), norm)

    def head_norm(self, qkv: torch.Tensor, attn: "Attention") -> None:
        """RMSNorm over each q head and each k head of qkv, in place (Qwen3, Gemma 3)."""
        T, H, Hkv, D = qkv.shape[0], attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
        q.copy_(self.rms_norm(q, attn.q_norm))
        k.copy_(self.rms_norm(k, attn.k_norm))

    def attention(self, qkv: torch.Tensor, attn: "Attention", ctx: "StepContext",
                  layer_idx: int) -> torch.Tensor:
        """RoPE on q and k, the new K/V into the cache, attention through the block
        tables: qkv [T, (H + 2 Hkv) * D] -> [T, H * D]."""
        T, H, Hkv, D = qkv.shape[0], attn.n_heads, attn.n_kv_heads, attn.head_dim
        # RoPE on q and k together: they are adjacent in qkv.
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), ctx.rope[attn.rope_index])
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        o = ctx.attention.forward(q, k, v, ctx.kv_cache[attn.kv_slot], ctx.plans[attn.kv_group],
                                  attn.scale, window=attn.window, softcap=attn.softcap,
                                  kv_scale=ctx.kv_scale(layer_idx))
        return o.reshape(T, H * D)

    def lm_head(self, x: torch.Tensor, model: "Transformer") -> torch.Tensor:
        """Final-normed rows [S, dim] -> float32 logits [S, vocab]."""
        return model.lm_head(x).float()


TORCH_OPS = TorchOps()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """As HF: normalise in float32, cast back, then scale by weight (Llama's order).
    offset != 0 (Gemma: scale by 1 + weight) scales in float32 before the cast, as
    Gemma's norm does. The norm is taken with vector_norm (one pass, no temporary)."""
    xf = x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    if offset:
        return (xf * inv_rms).mul_(weight.float() + offset).to(x.dtype)
    return (xf * inv_rms).to(x.dtype).mul_(weight)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP's gate activation, as HF names it (hidden_act / hidden_activation)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with rotary pairs interleaved (d = 2i, 2i + 1); rope:
    [T, 1, D // 2] complex. Returns a new [T, heads, D] tensor in x's dtype."""
    T, heads, D = x.shape
    pairs = torch.view_as_complex(x.float().reshape(T, heads, D // 2, 2))
    return torch.view_as_real(pairs * rope).view(T, heads, D).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), in place (Gemma 2's logit soft-capping); x when cap is None."""
    if cap is None:
        return x
    return x.div_(cap).tanh_().mul_(cap)

