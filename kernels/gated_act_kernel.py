"""Triton kernel for gated_act (launcher and checks: kernels/gated_act.py), and the
activation it applies, shared with gate_up_act_kernel.

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl

from kernels.rounding_kernel import round_to


@triton.jit
def activate(gate, ACT: tl.constexpr):
    """The gate's activation in float32; ACT is a code of gated_act.ACTIVATIONS."""
    if ACT == 0:  # SiLU
        act = gate * tl.sigmoid(gate)
    else:  # GELU, tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
        # with tanh(u) = 2 sigmoid(2u) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    return act


@triton.jit
def gated_act_kernel(
    out_ptr,  # [rows, n_cols]
    x_ptr,  # [rows, 2 * n_cols]: the gate's columns, then the up projection's
    stride_x,
    stride_out,
    n_cols,
    ACT: tl.constexpr,  # 0: SiLU; 1: GELU, tanh approximation
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # the activation rounded to the model's dtype before the product, as torch's
    # activation(gate).mul_(up) rounds it
    act = round_to(activate(gate, ACT), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, out_ptr.dtype.element_ty), mask=mask)
