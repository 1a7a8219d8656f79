"""fused_moe: the mixture-of-experts MLP of routed tokens, as two grouped GEMMs.

Token t goes to the k experts topk_ids[t] with weights topk_weights[t]:
    out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]
Weights are stored transposed ([in, out]): w_gate_up[e] is [dim, 2 * inter] with the
gate columns first, w_down[e] is [inter, dim].

Work split (a "pair" is one (token, j) slot, p = t * k + j; there are T * k of them):
* Align (torch ops on the device, `align_pairs`): pair ids are sorted by expert and
  each expert's run is padded to a multiple of BLOCK_M with the id num_pairs, so every
  BLOCK_M rows of `sorted_pair_ids` belong to one expert, `block_expert[b]`. The grid
  is sized from an upper bound on the padded rows (num_pairs + min(E, num_pairs) *
  (BLOCK_M - 1)), so no count is read back; blocks past the end have expert -1 and exit.
* Pass 1: program (m block, n block) gathers its pairs' tokens from x, multiplies them
  by expert e's gate and up columns n .. n + BLOCK_N (two fp32 accumulators) and writes
  act(gate) * up to h[pair], in x's dtype, like the dense MLP's intermediate.
* Pass 2: the same rows of h times expert e's w_down, scaled by the pair's routing
  weight, written in fp32 to y[pair]; out = y.view(T, k, dim).sum(1). No atomics, so
  the result does not depend on scheduling.
Both passes are one kernel (kernels/fused_moe_kernel.py) with constexpr epilogues.

`fused_moe_torch` is the same op in torch (loop over the experts that have tokens),
for CPU and wherever Triton is not available.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import _checks as checks
from kernels._triton import cdiv, interpreting, load_kernels

_OP = "fused_moe"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows


@dataclass(frozen=True, slots=True)
class MoeTiles:
    block_m: int  # pairs per program; each expert's pairs are padded to a multiple of it
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int


def choose_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype, block_m: int | None = None) -> MoeTiles:
    """Tile sizes from shapes only. BLOCK_M follows the pairs an expert gets on average:
    decode batches give each expert a few rows, and padding them to 64 would multiply
    the (tiny) activation traffic without saving any weight traffic. The gated pass
    keeps two accumulators; 8 warps and the BLOCK_K below keep it from spilling on
    sm_80/sm_90 (compile_check), and fp32 never uses 64 rows, which spills regardless."""
    if block_m is None:
        per_expert = num_pairs / max(1, min(num_experts, num_pairs))
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 or dtype == torch.float32 else 64
    block_k = 32 if dtype == torch.float32 or block_m >= 64 else 64
    return MoeTiles(block_m=block_m, block_n=64, block_k=block_k, num_warps=8)


def gemm_constants(dtype: torch.dtype, n: int, k: int, pairs_per_a_row: int, activation: str,
                   routed: bool, tiles: MoeTiles, interpret: bool) -> dict[str, object]:
    """The constexpr arguments of fused_moe_gemm_kernel for one pass."""
    upcast = interpret and dtype == torch.bfloat16
    return {
        "N": n,
        "K": k,
        "PAIRS_PER_A_ROW": pairs_per_a_row,
        "ACTIVATION": activation,
        "ROUTED": routed,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "UPCAST": upcast,
        "DOT_PRECISION": "ieee" if (dtype == torch.float32 or upcast) else "tf32",
    }


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the pairs by expert in BLOCK_M-row blocks, on topk_ids's device.

    Returns sorted_pair_ids [num_blocks * block_m] int32 (pair ids t * k + j, experts in
    increasing order, each expert's run padded with num_pairs to a multiple of block_m,
    then padding to the end) and block_expert [num_blocks] int32 (the expert of each
    block, -1 for the blocks past the last expert's run). num_blocks is the upper bound
    cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m).
    """
    expert_of_pair = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs = expert_of_pair.numel()
    device = topk_ids.device
    counts = torch.bincount(expert_of_pair, minlength=num_experts)  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(expert_of_pair, stable=True)  # pair ids, grouped by expert
    sorted_expert = expert_of_pair[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_expert]  # position in its expert's run
    num_blocks = cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    # the first expert whose padded run ends after the block's first row (empty runs end where they start)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids, block_expert


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """Mixture-of-experts MLP over routed tokens with Triton; returns [T, dim] in x's dtype.

    x: [T, dim] fp32/fp16/bf16, last dim contiguous.
    w_gate_up: [E, dim, 2 * inter] in x's dtype, last dim contiguous: per expert the
        transposed gate weight (columns 0 .. inter - 1), then the transposed up weight.
    w_down: [E, inter, dim] in x's dtype, last dim contiguous: transposed down weights.
    topk_weights: [T, k] fp32 routing weights, used as given (normalise them first if
        the model does).
    topk_ids: [T, k] int64/int32 expert ids in 0 .. E - 1 (checked: one small
        device-to-host read).
    activation: "silu" or "gelu_pytorch_tanh", applied to the gate.
    block_m: force the pairs per tile (a power of two >= 16; tests); None picks it.
    """
    _check_args(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    checks.check_triton_device(_OP, x)
    if block_m is not None and (block_m < MIN_BLOCK_M or block_m & (block_m - 1)):
        raise ValueError(f"{_OP}: block_m must be a power of two >= {MIN_BLOCK_M} or None, got {block_m}")
    num_tokens, dim = x.shape
    num_experts, inter = w_down.shape[:2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, dim, dtype=x.dtype, device=x.device)

    tiles = choose_tiles(num_pairs, num_experts, x.dtype, block_m)
    sorted_pair_ids, block_expert = align_pairs(topk_ids, num_experts, tiles.block_m)
    routing = topk_weights.reshape(-1).contiguous()  # [num_pairs]
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, dim, dtype=torch.float32, device=x.device)
    kernel = load_kernels("kernels.fused_moe_kernel").fused_moe_gemm_kernel
    interpret = interpreting()
    num_blocks = block_expert.shape[0]
    kernel[(num_blocks, cdiv(inter, tiles.block_n))](
        h, x, w_gate_up, routing, sorted_pair_ids, block_expert,
        num_pairs, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        **gemm_constants(x.dtype, inter, dim, top_k, activation, False, tiles, interpret),
        num_warps=tiles.num_warps,
    )
    kernel[(num_blocks, cdiv(dim, tiles.block_n))](
        y, h, w_down, routing, sorted_pair_ids, block_expert,
        num_pairs, h.stride(0), w_down.stride(0), w_down.stride(1),
        **gemm_constants(x.dtype, dim, inter, 1, "none", True, tiles, interpret),
        num_warps=tiles.num_warps,
    )
    return y.view(num_tokens, top_k, dim).sum(dim=1).to(x.dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """fused_moe in torch, on any device: one pair of matmuls per expert that has
    tokens. Same arguments and result; the matmuls run in x's dtype (torch accumulates
    them in fp32), the activation, routing weights and the sum over k in fp32."""
    _check_args(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    num_tokens, dim = x.shape
    num_experts, inter = w_down.shape[:2]
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, dim, dtype=torch.float32, device=x.device)
    expert_of_pair = topk_ids.reshape(-1).long()  # pair p = t * k + j
    routing = topk_weights.reshape(-1)
    order = torch.argsort(expert_of_pair, stable=True)  # pair ids, grouped by expert
    counts = torch.bincount(expert_of_pair, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = (x[tokens] @ w_gate_up[expert]).float()  # [count, 2 * inter]
        h = _activate(gate_up[:, :inter], activation) * gate_up[:, inter:]
        y = (h.to(x.dtype) @ w_down[expert]).float() * routing[pairs, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh")


def _check_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> None:
    checks.check_ndim(_OP, "x", x, 2, "[num_tokens, dim]")
    checks.check_ndim(_OP, "w_gate_up", w_gate_up, 3, "[num_experts, dim, 2 * inter]")
    checks.check_ndim(_OP, "w_down", w_down, 3, "[num_experts, inter, dim]")
    checks.check_ndim(_OP, "topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    checks.check_ndim(_OP, "topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, dim = x.shape
    num_experts, inter = w_down.shape[:2]
    if num_experts == 0 or inter == 0 or dim == 0:
        raise ValueError(
            f"{_OP}: need at least one expert and non-empty weights, got w_down shape {tuple(w_down.shape)} "
            f"and x shape {tuple(x.shape)}"
        )
    checks.check_dim_size(_OP, "w_gate_up", w_gate_up, 0, num_experts, "w_down.shape[0] (num_experts)")
    checks.check_dim_size(_OP, "w_gate_up", w_gate_up, 1, dim, "x.shape[1] (dim)")
    checks.check_dim_size(_OP, "w_gate_up", w_gate_up, 2, 2 * inter, "2 * w_down.shape[1] (2 * inter)")
    checks.check_dim_size(_OP, "w_down", w_down, 2, dim, "x.shape[1] (dim)")
    checks.check_dim_size(_OP, "topk_ids", topk_ids, 0, num_tokens, "x.shape[0] (num_tokens)")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"{_OP}: topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}"
        )
    checks.check_dtype(_OP, "x", x, checks.ATTENTION_DTYPES)
    checks.check_same_dtype(_OP, ("x", "w_gate_up", "w_down"), (x, w_gate_up, w_down))
    checks.check_dtype(_OP, "topk_weights", topk_weights, (torch.float32,))
    checks.check_dtype(_OP, "topk_ids", topk_ids, checks.INDEX_DTYPES)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        checks.check_last_dim_contiguous(_OP, name, t)
    checks.check_same_device(_OP, ("x", "w_gate_up", "w_down", "topk_weights", "topk_ids"),
                             (x, w_gate_up, w_down, topk_weights, topk_ids))
    if topk_ids.numel() > 0:
        low, high = torch.stack(torch.aminmax(topk_ids)).tolist()  # one device-to-host read
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"{_OP}: topk_ids must be expert ids in 0..{num_experts - 1}, got values in {low}..{high}"
            )
