"""Triton kernel for fused_moe (launcher, checks, the align step and the work split:
kernels/fused_moe.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # globals in a kernel must be constexpr


@triton.jit
def fused_moe_gemm_kernel(
    c_ptr,  # [num_pairs, N] contiguous: pass 1 act(gate) * up in x's dtype, pass 2 fp32
    a_ptr,  # [num_a_rows, K], last dim contiguous: pass 1 x (a row per token), pass 2 h (per pair)
    w_ptr,  # [num_experts, K, N] (pass 2) or [num_experts, K, 2 * N] (gated), last dim contiguous
    topk_weights_ptr,  # [num_pairs] fp32 routing weights, read when ROUTED
    sorted_pair_ids_ptr,  # [num_blocks * BLOCK_M] int32: pair ids grouped by expert, num_pairs = padding
    block_expert_ptr,  # [num_blocks] int32: the expert of each BLOCK_M rows, -1 past the last one
    num_pairs,  # num_tokens * top_k
    stride_a_row,
    stride_w_expert,
    stride_w_k,
    N: tl.constexpr,  # output columns (pass 1: intermediate size, pass 2: dim)
    K: tl.constexpr,  # reduction length (pass 1: dim, pass 2: intermediate size)
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when A is x (pair p is token p // top_k), 1 when A is h
    ACTIVATION: tl.constexpr,  # "silu" / "gelu_pytorch_tanh": c = act(gate) * up; "none": c = a @ w
    ROUTED: tl.constexpr,  # scale row p by topk_weights[p]
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (the interpreter has no bf16 math)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so they are not rounded to tf32
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # the grid is an upper bound on the padded row count
        return

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + rows)
    row_ok = pair < num_pairs
    a_rows = a_ptr + (pair // PAIRS_PER_A_ROW).to(tl.int64) * stride_a_row  # [BLOCK_M] row starts
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_expert = w_ptr + expert.to(tl.int64) * stride_w_expert
    ks = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # gate (gated) or the whole product
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # up columns, gated only
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + ks
        k_ok = k_idx < K
        a = tl.load(a_rows[:, None] + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_offs = k_idx[:, None] * stride_w_k + cols[None, :]
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_expert + w_offs, mask=w_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if ACTIVATION != "none":
            w_up = tl.load(w_expert + N + w_offs, mask=w_ok, other=0.0)  # up columns follow gate
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)

    if ACTIVATION == "silu":
        c = acc * tl.sigmoid(acc) * acc_up
    elif ACTIVATION == "gelu_pytorch_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): the tanh-approximated GELU without a tanh
        inner = _SQRT_2_OVER_PI * (acc + 0.044715 * acc * acc * acc)
        c = acc * tl.sigmoid(2.0 * inner) * acc_up
    else:
        c = acc
    if ROUTED:
        routing = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        c = c * routing[:, None]
    c_offs = pair.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(c_ptr + c_offs, c.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
