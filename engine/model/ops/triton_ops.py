"""The ops a model runs with on the Triton backend (CUDA, or the interpreter in tests):
TorchOps (engine/model/ops/torch_ops.py) with a layer's small ops fused into one launch each, as
the CPU path fuses them (engine/model/ops/cpu_ops.py):

* RMSNorm, and the residual add + RMSNorm (kernels/norm.py);
* the gated MLP's gate/up projection and activation, act(x @ gate) * (x @ up), at decode
  sizes (kernels/gate_up_act.py); past them cuBLAS's product, then the activation
  (kernels/gated_act.py);
* RoPE on q and k with the new K/V stored into the paged cache (kernels/rope_store_kv.py):
  the attention backend then reads K/V from the cache alone;
* the experts of an MoE layer (kernels/fused_moe.py).

What the kernels do not cover (a norm over heads, an activation they do not know) falls
through to TorchOps. Attention goes to the Triton attention backend, through the ops'
one attention call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.ops.attention import TritonAttention
from engine.model.ops.torch_ops import TorchOps

if TYPE_CHECKING:
    from engine.model.transformer import Attention, FeedForward, MoE, RMSNorm, StepContext

# Rows up to which the gated MLP's gate/up projection and activation run as one kernel
# (decode batches): one launch, and no [rows, 2 * intermediate] product written and read
# back. Past it (prefill), cuBLAS's GEMM then gated_act: the kernel's tiles are sized for
# few rows, and a large GEMM is what cuBLAS is tuned for.
GATE_UP_FUSED_MAX_ROWS = 256


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self) -> None:
        from kernels import gate_up_act, gated_act, norm, rope_store_kv

        self._norm, self._gated_act, self._rope_store_kv = norm, gated_act, rope_store_kv
        self._gate_up_act = gate_up_act

    def rms_norm(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        if x.dim() != 2:  # a norm over heads (Qwen3's q/k norms): torch's
            return super().rms_norm(x, norm)
        return self._norm.rms_norm(x, norm.weight, norm.eps, norm.offset)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        return self._norm.add_rms_norm(h, delta, norm.weight, norm.eps, norm.offset)

    def gate_up_act(self, x: torch.Tensor, ffn: "FeedForward") -> torch.Tensor:
        if ffn.activation not in self._gated_act.ACTIVATIONS:
            return super().gate_up_act(x, ffn)
        w = ffn.w_gate_up
        if x.shape[0] <= GATE_UP_FUSED_MAX_ROWS:
            return self._gate_up_act.gate_up_act(x, w.weight_t, w.bias, ffn.activation)
        return self._gated_act.gated_act(self.linear(x, w), ffn.activation)

    def attention(self, qkv: torch.Tensor, attn: "Attention", ctx: "StepContext",
                  layer_idx: int) -> torch.Tensor:
        if not isinstance(ctx.attention, TritonAttention):  # one that wants k and v (fp8 calibration)
            return super().attention(qkv, attn, ctx, layer_idx)
        T, H = qkv.shape[0], attn.n_heads
        # each pair's (cos, sin), [T, D / 2, 2] float32: a view of the step's rotations
        cos_sin = torch.view_as_real(ctx.rope[attn.rope_index]).view(T, -1, 2)
        kv_layer, plan = ctx.kv_cache[attn.kv_slot], ctx.plans[attn.kv_group]
        kv_scale = ctx.kv_scale(layer_idx)
        k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        q = self._rope_store_kv.rope_store_kv(qkv, cos_sin, kv_layer[0],
                                              kv_layer[1], plan.slot_mapping, H,
                                              attn.n_kv_heads, k_scale, v_scale)
        o = ctx.attention.forward(q, None, None, kv_layer, plan, attn.scale, window=attn.window,
                                  softcap=attn.softcap, kv_scale=kv_scale)
        return o.reshape(T, H * attn.head_dim)

    def moe(self, x: torch.Tensor, moe: "MoE") -> torch.Tensor:
        from kernels.fused_moe import fused_moe

        weights, ids = self.route(x, moe)
        return fused_moe(x, moe.experts_gate_up, moe.experts_down, weights, ids, moe.activation)
