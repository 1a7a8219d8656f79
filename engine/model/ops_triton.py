"""The ops a model runs with on the Triton backend (CUDA, or the interpreter in tests):
TorchOps (engine/model/ops.py) with the experts of an MoE layer run by the fused Triton
kernel (kernels/fused_moe.py). Attention goes to the Triton attention backend as on
every path, through the ops' one attention call."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.ops import TorchOps

if TYPE_CHECKING:
    from engine.model.transformer import MoE


class TritonOps(TorchOps):
    name = "triton"

    def moe(self, x: torch.Tensor, moe: "MoE") -> torch.Tensor:
        from kernels.fused_moe import fused_moe

        weights, ids = self.route(x, moe)
        return fused_moe(x, moe.experts_gate_up, moe.experts_down, weights, ids, moe.activation)
