"""Random paged batches for kernel tests and benchmarks.

`make_paged_batch` lays each sequence's K/V into a shuffled set of cache blocks
(non-contiguous, non-monotonic block tables) and fills everything a correct kernel
must not read with NaN: free blocks, the unused tail of each sequence's last block,
and the padding of the block tables (which points at a NaN block). A kernel that
reads outside a sequence's context therefore produces NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv


@dataclass(slots=True)
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with a NaN block
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim], position order
    values: list[torch.Tensor]  # per sequence, like keys
    scale: float


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
    extra_table_columns: int = 2,
    fill_unused_with_nan: bool = True,
) -> PagedBatch:
    """A batch whose sequence s has seq_lens[s] tokens of context, the last
    query_lens[s] of them new (their queries are in q)."""
    if len(seq_lens) != len(query_lens):
        raise ValueError("seq_lens and query_lens must have one entry per sequence")
    if any(ql > sl for sl, ql in zip(seq_lens, query_lens)):
        raise ValueError(f"query_lens {query_lens} must not exceed seq_lens {seq_lens}")
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    # block 0 is a poison block (NaN) used as the block-table padding
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if fill_unused_with_nan else 0.0
    key_cache = torch.full(cache_shape, fill, dtype=dtype, device=device)
    value_cache = torch.full(cache_shape, fill, dtype=dtype, device=device)

    shuffled = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
    width = max(max(blocks_per_seq, default=0) + extra_table_columns, 1)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    keys, values = [], []
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = torch.tensor(shuffled[:n_blocks], dtype=torch.int64)
        shuffled = shuffled[n_blocks:]
        block_tables[s, :n_blocks] = table.to(torch.int32)
        k = _randn((seq_len, num_kv_heads, head_dim), gen, dtype, device)
        v = _randn((seq_len, num_kv_heads, head_dim), gen, dtype, device)
        _scatter_into_blocks(key_cache, table.to(device), k, fill)
        _scatter_into_blocks(value_cache, table.to(device), v, fill)
        keys.append(k)
        values.append(v)

    num_tokens = sum(query_lens)
    q = _randn((num_tokens, num_q_heads, head_dim), gen, dtype, device)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        scale=head_dim ** -0.5,
    )


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype,
           device: torch.device | str) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _scatter_into_blocks(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, fill: float) -> None:
    """cache[table[i]] = rows[i * block_size:(i + 1) * block_size], the last block's tail = fill."""
    block_size = cache.shape[1]
    padded = torch.full((table.numel() * block_size, *rows.shape[1:]), fill,
                        dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    cache[table] = padded.view(table.numel(), block_size, *rows.shape[1:])
