"""Pure-torch references for every kernel op.

Written for obviousness, not speed: plain loops over tokens, sequences and blocks,
fp32 math. Tests compare the Triton kernels against these; nothing here shares code
with the kernels.
"""

from __future__ import annotations

import math

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; slot < 0 is padding
    k_scale: torch.Tensor | None = None,  # fp8 caches: [num_kv_heads] float32
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token i to cache[slot // block_size, slot % block_size], in place. An fp8
    cache gets key / k_scale (value / v_scale), clamped to the format's largest finite
    value and cast by torch (round to nearest even)."""
    if k_scale is not None:
        top = torch.finfo(key_cache.dtype).max
        key = (key.float() / k_scale[:, None]).clamp(-top, top).to(key_cache.dtype)
        value = (value.float() / v_scale[:, None]).clamp(-top, top).to(key_cache.dtype)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    num_blocks, block_size = key_cache.shape[:2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        if slot >= num_blocks * block_size:
            raise ValueError(f"slot {slot} of token {i} is past the cache ({num_blocks} x {block_size})")
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[i]
        value_cache[block, offset] = value[i]


def dequantize_cache_ref(
    cache: torch.Tensor,  # fp8 [num_blocks, block_size, num_kv_heads, head_dim]
    scale: torch.Tensor,  # [num_kv_heads] float32
) -> torch.Tensor:
    """The values an fp8 cache holds, in float32: stored value * its head's scale."""
    return cache.float() * scale[:, None]


def gather_sequence_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq], only the first cdiv(seq_len, block_size) used
    seq_len: int,
) -> torch.Tensor:
    """One sequence's keys (or values) in position order: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table.to(cache.device)[pos // block_size].long()
    return cache[blocks, pos % block_size]


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs], context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    window: int | None = None,  # sliding window: a row sees window - 1 keys back, and itself
    softcap: float | None = None,  # scores -> softcap * tanh(score / softcap)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Query row j of sequence s sits at position seq_lens[s] - q_len_s + j and sees keys
    at positions 0..that position (with a window, only the last `window` of them).
    Rows not owned by any sequence are left zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {s}: {q_len} new tokens but seq_len {seq_len}")
        k = gather_sequence_kv(key_cache, block_tables[s], seq_len).float()
        v = gather_sequence_kv(value_cache, block_tables[s], seq_len).float()
        # q head h reads kv head h // group
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].float()  # [q_len, num_q_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if window is not None:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


def copy_blocks_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [n, 2] of (src, dst)
) -> None:
    """For every layer, K and V: block dst = block src, in place."""
    for src, dst in block_mapping.tolist():
        kv_cache[:, :, dst] = kv_cache[:, :, src]


def swap_blocks_ref(
    src_cache: torch.Tensor,  # [num_layers, 2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_layers, 2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [n, 2] of (src block in src_cache, dst block in dst_cache)
) -> None:
    """Copy every layer's K and V block src (in src_cache) -> dst (in dst_cache), one at a time."""
    for src, dst in block_mapping.tolist():
        dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, dim]
    w_gate_up: torch.Tensor,  # [num_experts, dim, 2 * inter]: gate columns, then up columns
    w_down: torch.Tensor,  # [num_experts, inter, dim]
    topk_weights: torch.Tensor,  # [num_tokens, k]
    topk_ids: torch.Tensor,  # [num_tokens, k] expert ids
    activation: str = "silu",  # "silu" or "gelu_pytorch_tanh"
) -> torch.Tensor:
    """Mixture-of-experts MLP, one (token, expert) at a time, in fp32:
    out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j]."""
    num_experts = w_gate_up.shape[0]
    inter = w_gate_up.shape[2] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < num_experts:
                raise ValueError(f"token {t}, slot {j}: expert {e} is not in 0..{num_experts - 1}")
            xt = x[t].float()
            gate = xt @ w_gate_up[e, :, :inter].float()
            up = xt @ w_gate_up[e, :, inter:].float()
            if activation == "silu":
                act = gate / (1.0 + torch.exp(-gate))
            elif activation == "gelu_pytorch_tanh":
                act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)))
            else:
                raise ValueError(f"unknown activation {activation!r}")
            out[t] += float(topk_weights[t, j]) * ((act * up) @ w_down[e].float())
    return out.to(x.dtype)
