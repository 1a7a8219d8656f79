"""A forward pass of made-up sequences outside the KV pools, against a scratch cache just
big enough: the pools' sizing measures a full-budget step with it (kv_pools.py), an fp8
cache's calibration records each layer's K/V through it (fp8_scales.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.layout import KVLayout
from engine.model.ops.attention import AttentionBatch
from engine.model.fp8_scales import unit_scales
from engine.model.kv_pools import with_blocks
from kernels.fp8 import is_fp8


@dataclass(slots=True)
class ScratchPass:
    model: torch.nn.Module  # this rank's share of the heads, a split model's
    ops: object  # the runner's (engine/model/ops/torch_ops.py)
    kv_layout: KVLayout
    block_size: int
    device: torch.device
    kv_dtype: torch.dtype  # the K/V cache's: the scratch cache's unless told otherwise

    def __call__(self, sequences: list[list[int]], backend: object,
                 cache_dtype: torch.dtype | None = None) -> None:
        """A forward pass of fresh sequences (token ids) against a scratch cache just big
        enough (of cache_dtype: the K/V cache's by default), through `backend`."""
        args, bs, dev = self.model.args, self.block_size, self.device
        tables, slots, positions, qsl, next_block = [], [], [], [0], 0
        for seq in sequences:
            n = len(seq)
            nb = -(-n // bs)
            tables.append(list(range(next_block, next_block + nb)))
            slots.extend(range(next_block * bs, next_block * bs + n))
            positions.extend(range(n))
            qsl.append(qsl[-1] + n)
            next_block += nb
        cache_dtype = cache_dtype or self.kv_dtype
        cache = torch.zeros(with_blocks((self.kv_layout.slots, 2, bs, args.n_kv_heads,
                                         args.head_dim), next_block),
                            dtype=cache_dtype, device=dev)
        kv_scales = unit_scales(args.n_layers, args.n_kv_heads, dev) if is_fp8(cache_dtype) else None
        lens = [len(seq) for seq in sequences]
        batch = AttentionBatch(bs, tables, lens, qsl, torch.tensor(slots, device=dev))
        plan = backend.plan(batch)  # (every layer group in the same blocks)
        self.model(torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64, device=dev),
                   torch.tensor(positions, device=dev), cache, backend,
                   [plan] * self.kv_layout.num_groups,
                   torch.tensor([q - 1 for q in qsl[1:]], device=dev), self.ops,
                   kv_scales=kv_scales)
        del cache
