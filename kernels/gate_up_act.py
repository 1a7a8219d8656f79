"""gate_up_act: a gated MLP's gate/up projection and its activation in one launch,

    out = act(x @ W_gate + b_gate) * (x @ W_up + b_up)

for x [M, K] and the gate/up Linear's stored weight_t [K, 2N] (the gate's N columns,
then the up projection's) and bias [2N]. The output [M, N] is what gated_act makes of
the projection's [M, 2N] output, without writing and reading that back: one launch
instead of a GEMM and gated_act.

Meant for the few-row matmuls of decoding (M up to a few hundred): one program holds
BLOCK_M rows and BLOCK_N output columns, loops over all of K (no split), loads each x
tile once for both the gate and the up tile and keeps two float32 accumulators. Large
M (prefill) is better served by cuBLAS and gated_act; engine/model/ops/triton_ops.py
picks by M.

Rounding differs from the model's torch path (engine/model/ops/torch_ops.py:
TorchOps.gate_up_act), which rounds the projection to the model's dtype, then the
activation, then the product. This kernel keeps float32 from the accumulators to the
end and rounds once, so in bfloat16 it differs from the torch path by a few units in
the last place (it is the closer of the two to the exact value); in float32 the two
agree to accumulation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _checks as checks
from kernels._triton import cdiv, interpreting, load_kernels
from kernels.gated_act import ACTIVATIONS

_OP = "gate_up_act"


@dataclass(frozen=True, slots=True)
class GateUpTiles:
    block_m: int  # rows a program computes
    block_n: int  # output columns a program computes (each needs a gate and an up column)
    block_k: int  # reduction step
    num_warps: int


def choose_tiles(rows: int, dtype: torch.dtype, interpret: bool) -> GateUpTiles:
    """Tile sizes from the row count and dtype. 16 rows is the smallest tl.dot; more
    rows per program reuse each weight tile more, which pays once a batch has them.
    BLOCK_K shrinks as the accumulators grow, and fp32 never takes 64 rows, so that
    neither the sm_80 nor the sm_90 build spills (python -m kernels.compile_check).
    The sizes are not yet tuned on a GPU (benchmarks/bench_kernels.py times them)."""
    if interpret:
        return GateUpTiles(16, 32, 32, 4)  # small tiles: test shapes cross every tile edge
    wide = dtype == torch.float32
    block_m = 16 if rows <= 16 else 32 if rows <= 32 or wide else 64
    block_k = 32 if wide else 128 if block_m <= 32 else 64
    # 16-bit tiles past 16 rows spill on 4 warps; fp32's spill on 8 (sm_90)
    num_warps = 8 if block_m > 16 and not wide else 4
    # a few rows: narrower column tiles, twice the programs to stream the weights with
    # (the default model's 1,536 columns are 48 programs at 32, 24 at 64)
    return GateUpTiles(block_m, 32 if rows <= 16 else 64, block_k, num_warps)


def kernel_constants(dtype: torch.dtype, activation: str, has_bias: bool, tiles: GateUpTiles,
                     interpret: bool) -> dict[str, object]:
    """The constexpr arguments of gate_up_act_kernel."""
    upcast = interpret and dtype == torch.bfloat16
    return {
        "ACT": ACTIVATIONS[activation],
        "HAS_BIAS": has_bias,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "UPCAST": upcast,
        "DOT_PRECISION": "ieee" if (dtype == torch.float32 or upcast) else "tf32",
    }


def gate_up_act(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                activation: str) -> torch.Tensor:
    """act(x @ weight_t[:, :n] + bias[:n]) * (x @ weight_t[:, n:] + bias[n:]): a new
    [rows, n] tensor in x's dtype.

    x: [rows, k], last dimension contiguous; weight_t: [k, 2n] in x's dtype, last
    dimension contiguous (a Linear's stored weight, gate columns first); bias: [2n] or
    None; activation: "silu" or "gelu_pytorch_tanh".
    """
    _check(x, weight_t, bias, activation)
    rows, k = x.shape
    n = weight_t.shape[1] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    interpret = interpreting()
    tiles = choose_tiles(rows, x.dtype, interpret)
    kernel = load_kernels("kernels.gate_up_act_kernel").gate_up_act_kernel
    kernel[(cdiv(rows, tiles.block_m), cdiv(n, tiles.block_n))](
        out, x, weight_t, weight_t if bias is None else bias,
        rows, n, k, x.stride(0), weight_t.stride(0), out.stride(0),
        **kernel_constants(x.dtype, activation, bias is not None, tiles, interpret),
        num_warps=tiles.num_warps,
    )
    return out


def _check(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: unknown activation {activation!r}; one of {sorted(ACTIVATIONS)}")
    checks.check_ndim(_OP, "x", x, 2, "[rows, k]")
    checks.check_dtype(_OP, "x", x, checks.ATTENTION_DTYPES)
    checks.check_last_dim_contiguous(_OP, "x", x)
    checks.check_ndim(_OP, "weight_t", weight_t, 2, "[k, 2 * n]")
    checks.check_dim_size(_OP, "weight_t", weight_t, 0, x.shape[1], "x.shape[1] (k)")
    if weight_t.shape[1] % 2:
        raise ValueError(f"{_OP}: weight_t has {weight_t.shape[1]} columns; the gate and up "
                         "halves need an even number")
    checks.check_last_dim_contiguous(_OP, "weight_t", weight_t)
    names, tensors = ["x", "weight_t"], [x, weight_t]
    if bias is not None:
        checks.check_ndim(_OP, "bias", bias, 1, "[2 * n]")
        checks.check_dim_size(_OP, "bias", bias, 0, weight_t.shape[1], "weight_t.shape[1] (2 * n)")
        checks.check_last_dim_contiguous(_OP, "bias", bias)
        names.append("bias")
        tensors.append(bias)
    checks.check_same_dtype(_OP, names, tensors)
    checks.check_same_device(_OP, names, tensors)
    checks.check_triton_device(_OP, x)
