"""Triton kernel for gate_up_act (launcher, checks and tile sizes: kernels/gate_up_act.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl

from kernels.gated_act_kernel import activate
from kernels.rounding_kernel import round_to


@triton.jit
def gate_up_act_kernel(
    out_ptr,  # [M, N], rows stride_out apart
    x_ptr,  # [M, K], rows stride_x apart
    w_ptr,  # [K, 2 * N], rows stride_w apart: the gate's N columns, then the up projection's
    bias_ptr,  # HAS_BIAS: [2 * N], the same order (else any pointer, unread)
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    ACT: tl.constexpr,  # a code of gated_act.ACTIVATIONS
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in fp32 (the interpreter has no bf16 math)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so they are not rounded to tf32
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1] row starts
    ks = tl.arange(0, BLOCK_K)

    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + ks
        k_ok = k_idx < K
        # one x tile for both products
        x = tl.load(x_rows + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_tile = w_ptr + k_idx.to(tl.int64)[:, None] * stride_w + cols[None, :]  # gate columns
        w_ok = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_tile, mask=w_ok, other=0.0)
        w_up = tl.load(w_tile + N, mask=w_ok, other=0.0)  # the up columns, N further on
        if UPCAST:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate += tl.dot(x, w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(x, w_up, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # float32 from the accumulators to the store: rounded once, where the torch path
    # rounds the product, the activation and the result (kernels/gate_up_act.py)
    out = activate(gate, ACT) * up
    out_offs = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptr + out_offs, round_to(out, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
