"""Launch planning for paged_attention: tile sizes and the number of KV splits.

Host-side only, from shapes and optional bounds, so choosing a plan never waits for
the GPU. Split-KV pays off when a batch has too few (query tile, KV head) programs to
fill the GPU, i.e. a few long decodes; it never cuts a context into slices shorter
than MIN_TOKENS_PER_SPLIT keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv, interpreting, next_power_of_2

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in merging than it saves
WAVES = 2  # aim for this many programs per SM


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    block_q: int  # query tokens per tile
    group_pad: int  # query heads per KV head, rounded up to a power of two
    tile_n: int  # keys per inner iteration
    num_splits: int  # KV splits per query tile (1: no merge kernel)
    num_warps: int

    @property
    def block_m(self) -> int:
        """Rows of one query tile: block_q tokens x group_pad heads."""
        return self.block_q * self.group_pad


def choose_num_splits(num_q_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits per query tile: enough programs for WAVES waves, each split at least
    MIN_TOKENS_PER_SPLIT keys long. Many tiles (prefill, big decode batches) get 1."""
    programs = max(1, num_q_tiles * num_kv_heads)
    wanted = cdiv(WAVES * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_launch_plan(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int,
    max_query_len: int,
    num_sms: int,
    num_splits: int | None,
    interpret: bool = False,
) -> LaunchPlan:
    group_pad = next_power_of_2(num_q_heads // num_kv_heads)
    head_dim_pad = next_power_of_2(head_dim)
    # 16 rows is the smallest tl.dot; long chunks (prefill) reuse each K/V tile over 64
    # rows, except with head_dim > 128, where a 64-row fp32 accumulator spills.
    rows = 64 if max_query_len >= 64 and head_dim_pad <= 128 else 16
    block_q = max(1, rows // group_pad)
    # Sizes picked so that neither the sm_80 nor the sm_90 build spills registers
    # (see python -m kernels.compile_check).
    if interpret:
        tile_n = 16  # small tiles so short test sequences still cross tiles and splits
    elif rows == 64:
        tile_n = 16 if dtype == torch.float32 else 32
    else:
        tile_n = 16 if dtype == torch.float32 or head_dim_pad >= 128 else 32
    num_warps = 8 if rows == 64 or head_dim_pad >= 128 else 4
    if num_splits is None:
        # tiles that hold at least one token: exact for decodes, a bound otherwise
        num_q_tiles = min(num_tokens, num_tokens // block_q + num_seqs)
        num_splits = choose_num_splits(num_q_tiles, num_kv_heads, max_seq_len, num_sms)
    return LaunchPlan(block_q, group_pad, tile_n, num_splits, num_warps)


def plan_launch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> LaunchPlan:
    """The plan paged_attention uses for these arguments."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = block_tables.shape[0]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if max_query_len is None:
        # exact bound when every sequence has at least one new token; a heuristic otherwise
        max_query_len = max(1, num_tokens - num_seqs + 1)
    return choose_launch_plan(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, q.dtype,
                              max_seq_len, max_query_len, num_sms(q.device), num_splits, interpreting())


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no occupancy to fill; tests force splits explicitly
