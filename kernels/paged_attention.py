"""paged_attention: one varlen kernel for prefill chunks and decodes over a paged KV cache.

The batch's new tokens are concatenated in `q`; sequence s owns rows
query_start_loc[s]:query_start_loc[s+1]. Its new tokens' K/V are already in the
cache (reshape_and_cache ran first), so the kernel only reads the cache: query row j
of sequence s sits at position seq_lens[s] - q_len_s + j and attends causally to
positions 0..that position, read through block_tables[s]. A decode is a chunk of one
token, a plain prefill a chunk with nothing cached before it.

Work split (program = one tile of queries of one sequence, for one KV head, one split):
* A query tile holds BLOCK_Q tokens of one sequence times the GROUP query heads that
  share the KV head, so BLOCK_M = BLOCK_Q * GROUP_PAD rows read each K/V tile once.
* Tiles are numbered without knowing the query lengths on the host: sequence s's
  tiles start at query_start_loc[s] // BLOCK_Q + s, so num_tokens // BLOCK_Q + num_seqs
  programs always suffice; a program finds its sequence by binary search and exits if
  it is past the end of that sequence's tokens.
* Split-KV ("flash-decoding"): with NUM_SPLITS > 1 each program covers one slice of
  the context and writes an unnormalised partial (acc, running max, running sum); a
  second kernel merges the slices. This fills the GPU when few long decodes run.
Softmax runs online in fp32 in the log2 domain (exp2 with scale * log2(e)).
"""

from __future__ import annotations

import torch

from kernels import _checks as checks
from kernels._triton import interpreting, load_kernels, next_power_of_2
from kernels.fp8 import is_fp8
from kernels.paged_attention_plan import LaunchPlan, plan_launch

_OP = "paged_attention"
_Q_LAYOUT = "[num_tokens, num_q_heads, head_dim]"
_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # the fp32 accumulator is BLOCK_M x head_dim registers per program


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged context; returns out.

    q: [num_tokens, num_q_heads, head_dim], fp32/fp16/bf16, last dim contiguous; the
        new tokens of all sequences concatenated.
    key_cache, value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim],
        q's dtype or fp8 (float8_e4m3fn, float8_e5m2: read as k_scale * the stored
        value); block_size a power of two. num_q_heads % num_kv_heads == 0.
    block_tables: [num_seqs, max_blocks_per_seq] int32; entries past
        cdiv(seq_lens[s], block_size) are never read.
    seq_lens: [num_seqs] int32, context length including the new tokens (>= q_len).
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths starting at 0.
        Rows of q past query_start_loc[-1] are padding; their output is unspecified.
    scale: softmax scale, usually head_dim ** -0.5.
    out: optional contiguous output [num_tokens, num_q_heads, head_dim] in q's dtype.
    num_splits: force the number of KV splits (tests); None picks it from the context
        length and the batch so that few long decodes still fill the GPU.
    max_seq_len, max_query_len: optional host-side bounds used only to pick tile
        sizes and splits; default to bounds derived from shapes (no device sync).
    window: a sliding-window layer: the query at position p sees keys p - window + 1
        .. p only (the blocks before are never read: they may have been given back).
    softcap: scores (scale * q.k) become softcap * tanh(score / softcap) (Gemma 2).
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache only.
    """
    if window is not None and window < 1:
        raise ValueError(f"{_OP}: window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{_OP}: softcap must be > 0 or None, got {softcap}")
    _check_args(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    fp8 = is_fp8(key_cache.dtype)
    if fp8:
        from kernels.reshape_and_cache import check_kv_scales

        check_kv_scales(_OP, key_cache.shape[2], q.device, k_scale, v_scale)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{_OP}: k_scale/v_scale are for an fp8 cache; this one is "
                         f"{key_cache.dtype}")
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"{_OP}: num_splits must be in 1..1024 or None, got {num_splits}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    plan = plan_launch(q, key_cache, block_tables, num_splits, max_seq_len, max_query_len)

    if plan.num_splits == 1:
        part_acc = part_max = part_sum = out  # not touched: the kernel writes out directly
    else:
        part_acc = torch.empty(num_tokens, num_q_heads, plan.num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_q_heads, plan.num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    _, block_size, num_kv_heads, _ = key_cache.shape
    constants = attention_constants(q.dtype, num_q_heads, num_kv_heads, head_dim, block_size, plan,
                                    interpreting(), window=window is not None,
                                    softcap=softcap is not None, fp8=fp8)
    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads, plan.num_splits)
    triton_kernels = load_kernels("kernels.paged_attention_kernel")
    triton_kernels.paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,  # (unread unless fp8)
        scale * _LOG2E, window or 0, softcap or 0.0, num_seqs,
        q.stride(0), q.stride(1), block_tables.stride(0),
        **constants,
        num_warps=plan.num_warps,
    )
    if plan.num_splits > 1:
        triton_kernels.merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, num_seqs,
            **merge_constants(num_q_heads, head_dim, plan.num_splits),
        )
    return out


def attention_constants(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int, plan: LaunchPlan, interpret: bool, window: bool = False,
                        softcap: bool = False, fp8: bool = False) -> dict[str, object]:
    """The constexpr arguments of _paged_attention_kernel for one launch."""
    upcast = interpret and dtype == torch.bfloat16
    return {
        "NUM_Q_HEADS": num_q_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "GROUP": num_q_heads // num_kv_heads,
        "GROUP_PAD": plan.group_pad,
        "BLOCK_Q": plan.block_q,
        "TILE_N": plan.tile_n,
        "NUM_SPLITS": plan.num_splits,
        "UPCAST": upcast,
        "DOT_PRECISION": "ieee" if (dtype == torch.float32 or upcast) else "tf32",
        "WINDOW": window,
        "SOFTCAP": softcap,
        "FP8": fp8,
    }


def merge_constants(num_q_heads: int, head_dim: int, num_splits: int) -> dict[str, object]:
    """The constexpr arguments of _merge_splits_kernel for one launch."""
    return {
        "NUM_Q_HEADS": num_q_heads,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": next_power_of_2(head_dim),
        "NUM_SPLITS": num_splits,
        "SPLITS_PAD": next_power_of_2(num_splits),
    }


def _check_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    checks.check_ndim(_OP, "q", q, 3, _Q_LAYOUT)
    checks.check_ndim(_OP, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "value_cache", value_cache, 4, _CACHE_LAYOUT)
    checks.check_ndim(_OP, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    checks.check_ndim(_OP, "seq_lens", seq_lens, 1, "[num_seqs]")
    checks.check_ndim(_OP, "query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{_OP}: value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    checks.check_dim_size(_OP, "key_cache", key_cache, 3, head_dim, "q.shape[2] (head_dim)")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"{_OP}: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    checks.check_power_of_two(_OP, "block_size (key_cache.shape[1])", block_size)
    num_seqs = block_tables.shape[0]
    checks.check_dim_size(_OP, "seq_lens", seq_lens, 0, num_seqs, "block_tables.shape[0] (num_seqs)")
    checks.check_dim_size(_OP, "query_start_loc", query_start_loc, 0, num_seqs + 1,
                          "num_seqs + 1")
    checks.check_dtype(_OP, "q", q, checks.ATTENTION_DTYPES)
    if is_fp8(key_cache.dtype):
        checks.check_same_dtype(_OP, ("key_cache", "value_cache"), (key_cache, value_cache))
    else:
        checks.check_same_dtype(_OP, ("q", "key_cache", "value_cache"),
                                (q, key_cache, value_cache))
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        checks.check_dtype(_OP, name, t, (torch.int32,))
    checks.check_last_dim_contiguous(_OP, "q", q)
    checks.check_contiguous(_OP, "key_cache", key_cache, _CACHE_LAYOUT)
    checks.check_contiguous(_OP, "value_cache", value_cache, _CACHE_LAYOUT)
    checks.check_last_dim_contiguous(_OP, "block_tables", block_tables)
    checks.check_contiguous(_OP, "seq_lens", seq_lens, "[num_seqs]")
    checks.check_contiguous(_OP, "query_start_loc", query_start_loc, "[num_seqs + 1]")
    names = ["q", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc"]
    tensors = [q, key_cache, value_cache, block_tables, seq_lens, query_start_loc]
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(
                f"{_OP}: out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}, got "
                f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}"
            )
        names.append("out")
        tensors.append(out)
    checks.check_same_device(_OP, names, tensors)
    checks.check_triton_device(_OP, q)
