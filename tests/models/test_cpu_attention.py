"""kernels/cpu_attention.py against the pure-torch reference (kernels.reference), on
odd shapes: block sizes, GQA ratios, lengths that are not powers of two, and batches
mixing decodes, prefills with and without a cached prefix."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.cpu_attention import paged_attention, paged_attention_varlen, plan_attention
from kernels.reference import paged_attention_ref, reshape_and_cache_ref

ATOL = RTOL = 1e-5  # float32 on both sides; only the summation order differs


def make_batch(seed: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
               seqs: list[tuple[int, int]], num_blocks: int = 96):
    """seqs: (context length incl. new tokens, new tokens). Blocks are handed out in a
    shuffled order so tables are not contiguous runs."""
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, qsl = [], [0]
    for seq_len, _ in seqs:
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], q_heads, head_dim, generator=g)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    return q, key_cache, value_cache, bt, torch.tensor([s for s, _ in seqs], dtype=torch.int32), \
        torch.tensor(qsl, dtype=torch.int32)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_batch_matches_reference(block_size, q_heads, kv_heads, head_dim):
    seqs = [(1, 1), (37, 1), (19, 19), (45, 13), (3, 1), (70, 1), (23, 2), (64, 1)]
    q, kc, vc, bt, lens, qsl = make_batch(block_size * 7 + q_heads, block_size, q_heads,
                                          kv_heads, head_dim, seqs, num_blocks=300)
    scale = head_dim ** -0.5
    expected = paged_attention_ref(q, kc, vc, bt, lens, qsl, scale)
    got = paged_attention_varlen(q, kc, vc, bt, lens, qsl, scale)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_prefill_without_prefix_may_use_the_fresh_kv():
    """Passing new_key/new_value (as the model does) gives the same answer as reading
    the cache back."""
    block_size, kv_heads, head_dim = 4, 2, 16
    seqs = [(10, 10), (7, 1), (9, 9)]
    q, kc, vc, bt, lens, qsl = make_batch(3, block_size, 4, kv_heads, head_dim, seqs)
    k_new = torch.randn(q.shape[0], kv_heads, head_dim)
    v_new = torch.randn(q.shape[0], kv_heads, head_dim)
    slots = []
    for s, (seq_len, q_len) in enumerate(seqs):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(bt[s, pos // block_size]) * block_size + pos % block_size)
    reshape_and_cache_ref(k_new, v_new, kc, vc, torch.tensor(slots))
    plan = plan_attention([t.tolist() for t in bt], lens.tolist(), qsl.tolist(), block_size)
    got = paged_attention(q, kc, vc, plan, 0.25, new_key=k_new, new_value=v_new)
    expected = paged_attention_ref(q, kc, vc, bt, lens, qsl, 0.25)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_decodes_of_very_different_lengths_form_groups():
    lens = [3, 5, 200, 210, 90]
    plan = plan_attention([list(range(-(-n // 4))) for n in lens], lens,
                          list(range(len(lens) + 1)), 4)
    assert len(plan.decode_groups) > 1
    assert sorted(r for g in plan.decode_groups for r in g.rows.tolist()) == list(range(5))


def test_plan_rejects_a_short_block_table():
    with pytest.raises(ValueError, match="need 3 blocks"):
        plan_attention([[0, 1]], [9], [0, 1], 4)


@pytest.mark.parametrize("block_size,q_heads,kv_heads", [(4, 6, 2), (16, 9, 3), (1, 4, 4)])
def test_decodes_sharing_a_prefix_attend_to_it_once(block_size, q_heads, kv_heads):
    """Cascade attention: decodes whose tables start with the same blocks (a cached
    prompt prefix) match the reference, alone or mixed with other decodes/prefills."""
    head_dim, shared_blocks = 16, 5
    seqs = [(shared_blocks * block_size + n, 1) for n in (1, 7, 30, 12)] + [(21, 1), (17, 9)]
    q, kc, vc, bt, lens, qsl = make_batch(11, block_size, q_heads, kv_heads, head_dim, seqs,
                                          num_blocks=300)
    for s in range(1, 4):  # the first four decodes share their leading blocks
        bt[s, :shared_blocks] = bt[0, :shared_blocks]
    tables = [row[:-(-int(n) // block_size)].tolist() for row, n in zip(bt, lens)]
    plan = plan_attention(tables, lens.tolist(), qsl.tolist(), block_size)
    assert len(plan.shared_prefixes) == 1 and plan.shared_prefixes[0].rows.tolist() == [0, 1, 2, 3]
    got = paged_attention(q, kc, vc, plan, 0.3)
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, bt, lens, qsl, 0.3),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (17, 2.0), (None, 3.0),
                                            (300, None)])
def test_windowed_and_soft_capped_attention(block_size, window, softcap):
    """windowed_attention (sliding layers, Gemma 2's capped scores) against the
    reference, on decodes, chunks that start inside and outside the window, and a
    window longer than every context."""
    from kernels.cpu_attention import windowed_attention

    seqs = [(1, 1), (9, 1), (40, 1), (23, 23), (37, 6), (70, 31)]
    q, kc, vc, bt, sl, qsl = make_batch(3, block_size, 6, 2, 16, seqs, num_blocks=200)
    tables = [row[:-(-s // block_size)] for row, s in zip(bt.tolist(), sl.tolist())]
    got = windowed_attention(q, kc, vc, tables, sl.tolist(), qsl.tolist(), 0.3, window, softcap)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    if window and window < 40:  # the window changes the answer
        full = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.3, softcap=softcap)
        assert not torch.allclose(got, full, atol=1e-3)
