"""Where each layer's K/V lives: layer groups, each with a block table of its own.

A global layer needs the K/V of every token; a sliding layer only of the last `window`.
With one block table for all layers, a block holds every layer's K/V and none can go
back while a global layer still reads it: the sliding layers' share of the pool (5/6 of
it for Gemma 3) is spent on tokens they never look at again. So a model that mixes the
two kinds (Gemma 2 and 3) splits its layers into groups of the same size, as vLLM's
hybrid KV-cache manager does: every layer of a group has the same window, and a block of
the pool holds the K/V of one group's layers (the cache has `slots` layers per block;
layer i writes slot layer_slot[i] of its group's blocks). Each group keeps its own block
table per request, in one shared pool (engine/kv/group.py, engine/kv/coordinator.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.block_hash import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The cache key of a block of layer group `group` (> 0) holding the tokens that
    block_hash names (group 0 caches under the request's own hashes)."""
    return hashlib.sha256(b"kvops-group\0" + bytes([group]) + block_hash).digest()


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where each layer's K/V lives in the cache."""
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None: global
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its place among its group's layers
    slots: int  # layers per block (the cache's first dimension)

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_layout(layer_windows: tuple[int, ...], n_layers: int, hybrid: bool = True) -> KVLayout:
    """The layout for layers with these sliding windows (0: global; empty: all global).

    One group, every layer in every block, unless the model mixes global layers with
    sliding ones of one window and `hybrid` is on: then groups of k layers, k the fewer
    of the two kinds, the global groups first (the last group of a kind may have fewer
    than k layers: its blocks leave the other slots unused)."""
    windows = tuple(layer_windows) or (0,) * n_layers
    sliding = sorted({w for w in windows if w})
    full = [i for i, w in enumerate(windows) if not w]
    if not hybrid or not full or len(sliding) != 1 or len(full) == n_layers:
        # every layer slides: blocks older than the widest window can go back
        window = max(windows) if windows and min(windows) > 0 else None
        return KVLayout((window,), (0,) * n_layers, tuple(range(n_layers)), n_layers)
    slides = [i for i, w in enumerate(windows) if w]
    k = min(len(full), len(slides))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * n_layers, [0] * n_layers
    for layers, window in ((full, None), (slides, sliding[0])):
        for start in range(0, len(layers), k):
            for slot, layer in enumerate(layers[start:start + k]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), k)


def block_bytes(layout: KVLayout, block_size: int, n_kv_heads: int, head_dim: int,
                itemsize: int) -> int:
    """One block's bytes: K and V of the layers a block holds (every layer, or a layer
    group's: `layout.slots`), for `n_kv_heads` heads (a rank's share of a split model)
    of `head_dim` values of `itemsize` bytes. The one formula: the runner sizes its
    pools by it, the benchmarks and the what-if read it."""
    return layout.slots * 2 * block_size * n_kv_heads * head_dim * itemsize


def blocks_for(num_tokens: int, block_size: int, windows: tuple[int | None, ...],
               chunk: int = 0) -> int:
    """Blocks a request of num_tokens holds at most, with a table per window (None:
    global): a global table every block, a sliding one those the window and a step's
    chunk of `chunk` tokens reach, plus one."""
    n = cdiv(num_tokens, block_size)
    return sum(n if w is None else min(n, cdiv(w + chunk, block_size) + 1) for w in windows)
