"""Triton kernel for rms_norm and add_rms_norm (launchers and checks: kernels/norm.py).

Imported on the first launch only, so that importing `kernels` never imports Triton.
"""

import triton
import triton.language as tl

from kernels.rounding_kernel import round_to


@triton.jit
def rms_norm_kernel(
    out_ptr,  # [rows, cols], rows `stride_out` apart
    x_ptr,  # [rows, cols]: the input; with HAS_DELTA the residual stream, updated in place
    delta_ptr,  # HAS_DELTA: [rows, cols] added to x first (else any pointer, unread)
    weight_ptr,  # [cols]
    stride_x,
    stride_delta,
    stride_out,
    n_cols,
    eps,
    offset,  # HAS_OFFSET: scale by (offset + weight) in float32 (Gemma)
    HAS_DELTA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= n_cols: one program holds a whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        # rounded to the stream's dtype, as torch's h.add_(delta) leaves it
        x = round_to(x.to(tl.float32) + delta.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        y = xf * inv_rms * (w + offset)
        tl.store(out_ptr + row * stride_out + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)
    else:  # Llama's order: normalised, cast back, then scaled in the model's dtype
        y = round_to(xf * inv_rms, x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_out + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)
