"""rms_norm and add_rms_norm: RMSNorm over the rows of a 2-D tensor, optionally after
adding a residual delta in place, in one launch each.

The model's torch path (engine/model/ops/torch_ops.py: rms_norm, TorchOps.add_rms_norm) is the
reference: normalise in float32, cast to the input's dtype, then scale by the weight
(Llama's order); with an offset (Gemma: scale by 1 + weight) the scaling happens in
float32 before the cast. One program per row holds the whole row.
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels._triton import load_kernels, next_power_of_2

_OP = "rms_norm"
_LAYOUT = "[rows, cols]"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of each row of x [rows, cols] (last dimension contiguous) by weight [cols]:
    a new tensor in x's dtype."""
    _check(x, None, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(out, x, None, weight, eps, offset)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> torch.Tensor:
    """h += delta in place (h is a residual stream, rounded to its dtype as torch's add_
    leaves it), then RMSNorm of h's rows: a new tensor in h's dtype."""
    _check(h, delta, weight)
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    _launch(out, h, delta, weight, eps, offset)
    return out


def _launch(out: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
            eps: float, offset: float) -> None:
    rows, cols = x.shape
    if rows == 0:
        return
    block = next_power_of_2(cols)
    kernel = load_kernels("kernels.norm_kernel").rms_norm_kernel
    kernel[(rows,)](
        out, x, x if delta is None else delta, weight,
        x.stride(0), 0 if delta is None else delta.stride(0), out.stride(0),
        cols, float(eps), float(offset),
        HAS_DELTA=delta is not None, HAS_OFFSET=bool(offset), BLOCK=block,
        num_warps=norm_warps(block),
    )


def norm_warps(block: int) -> int:
    """Warps for a row of `block` elements: about 8 to 16 elements a thread."""
    return max(1, min(16, block // 256))


def _check(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> None:
    checks.check_ndim(_OP, "x", x, 2, _LAYOUT)
    checks.check_dtype(_OP, "x", x, checks.ATTENTION_DTYPES)
    checks.check_last_dim_contiguous(_OP, "x", x)
    checks.check_ndim(_OP, "weight", weight, 1, "[cols]")
    checks.check_dim_size(_OP, "weight", weight, 0, x.shape[1], "x.shape[1] (cols)")
    checks.check_contiguous(_OP, "weight", weight, "[cols]")
    names, tensors = ["x", "weight"], [x, weight]
    if delta is not None:
        if delta.shape != x.shape:
            raise ValueError(f"{_OP}: delta shape {tuple(delta.shape)} != h shape {tuple(x.shape)}")
        checks.check_same_dtype(_OP, ("h", "delta"), (x, delta))
        checks.check_last_dim_contiguous(_OP, "delta", delta)
        names.append("delta")
        tensors.append(delta)
    checks.check_same_device(_OP, names, tensors)
    checks.check_triton_device(_OP, x)
