"""gated_act: a gated MLP's activation, act(gate) * up, in one launch.

The input is the gate/up projection's output [rows, 2 * n] (the gate's n columns, then
the up projection's), the output [rows, n]. The model's torch path (engine/model/ops/torch_ops.py:
TorchOps.gate_up_act, `activation(name, gate).mul_(up)`) is the reference: the activation
is rounded to the model's dtype before the product, as torch rounds it.
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels._triton import cdiv, load_kernels

_OP = "gated_act"
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # HF's hidden_act names
_BLOCK = 1024  # columns a program computes


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate_up[:, :n]) * gate_up[:, n:] for gate_up [rows, 2n] (last dimension
    contiguous): a new [rows, n] tensor in its dtype. activation: "silu" or
    "gelu_pytorch_tanh"."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: unknown activation {activation!r}; one of {sorted(ACTIVATIONS)}")
    checks.check_ndim(_OP, "gate_up", gate_up, 2, "[rows, 2 * n]")
    checks.check_dtype(_OP, "gate_up", gate_up, checks.ATTENTION_DTYPES)
    checks.check_last_dim_contiguous(_OP, "gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"{_OP}: gate_up has {gate_up.shape[1]} columns; the gate and up "
                         "halves need an even number")
    checks.check_triton_device(_OP, gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or n == 0:
        return out
    kernel = load_kernels("kernels.gated_act_kernel").gated_act_kernel
    kernel[(rows, cdiv(n, _BLOCK))](out, gate_up, gate_up.stride(0), out.stride(0), n,
                                     ACT=ACTIVATIONS[activation], BLOCK=_BLOCK)
    return out
