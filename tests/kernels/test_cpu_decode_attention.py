"""kvops::paged_decode_attention (kernels/csrc/paged_decode_attention.cpp) against the
torch reference: block sizes, GQA ratios, head sizes on the vector path (multiples of
16) and off it, lengths that are not powers of two, scattered block tables, a strided
q, and the checks that refuse bad arguments."""
from __future__ import annotations

import os
import random

import pytest
import torch

from kernels import cpu_ext
from kernels.cpu_attention import paged_attention, plan_attention
from kernels.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(os.environ.get("KVOPS_CPU_KERNELS") == "0",
                                reason="KVOPS_CPU_KERNELS=0 turns the CPU kernels off")

ATOL = RTOL = 2e-5  # float32 on both sides; summation order and exp() differ


@pytest.fixture(scope="module")
def ops():
    return cpu_ext.ops()  # builds the kernels (or fails the tests with the compiler's error)


def decode_batch(seed: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
                 lens: list[int], num_blocks: int = 400):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    # q rows with extra heads around them: a strided view, as the model passes it
    q = torch.randn(len(lens), q_heads + kv_heads, head_dim, generator=g)[:, :q_heads]
    return q, kc, vc, tables


def reference(q, kc, vc, tables, lens, scale):
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    return paged_attention_ref(q.contiguous(), kc, vc, bt, torch.tensor(lens, dtype=torch.int32),
                               torch.arange(len(lens) + 1, dtype=torch.int32), scale)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 128])
def test_decodes_match_the_reference(ops, block_size, q_heads, kv_heads, head_dim):
    """Also the vector path's edge cases: tiles of 16 positions that cross blocks (block
    sizes under 16) or end inside one, and head sizes off the vector path (24, 80)."""
    lens = [1, 2, 15, 16, 17, 33, 100, 257, 5]
    q, kc, vc, tables = decode_batch(block_size + head_dim + q_heads, block_size, q_heads,
                                     kv_heads, head_dim, lens,
                                     num_blocks=sum(-(-n // block_size) for n in lens) + 3)
    scale = head_dim ** -0.5
    plan = plan_attention(tables, lens, list(range(len(lens) + 1)), block_size,
                          native=True)
    assert plan.native_rows is not None and not plan.decode_groups
    got = paged_attention(q, kc, vc, plan, scale)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lens, scale),
                               atol=ATOL, rtol=RTOL)


def test_large_scores_do_not_overflow(ops):
    """Scores in the hundreds (softmax of nearly one-hot rows) stay finite and exact."""
    lens = [40, 3, 77]
    q, kc, vc, tables = decode_batch(5, 8, 4, 2, 32, lens)
    got = paged_attention(q * 30, kc, vc, plan_attention(tables, lens, [0, 1, 2, 3], 8,
                                                          native=True), 1.0)
    expected = reference(q * 30, kc, vc, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_min_rows", [8, 100, 2])
def test_mixed_batch_with_prefills(ops, chunk_min_rows):
    """Decodes and short chunks go row by row to paged_decode_attention, chunks of at
    least chunk_min_rows tokens (with and without a cached prefix) to
    paged_prefill_attention. Every row matches the reference."""
    block_size, q_heads, kv_heads, head_dim = 4, 6, 2, 16
    seqs = [(1, 1), (37, 1), (19, 19), (45, 13), (70, 1), (23, 2)]
    g = torch.Generator().manual_seed(9)
    kc = torch.randn(200, block_size, kv_heads, head_dim, generator=g)
    vc = torch.randn(200, block_size, kv_heads, head_dim, generator=g)
    free = list(range(200))
    random.Random(9).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n, _ in seqs]
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], q_heads, head_dim, generator=g)
    lens = [n for n, _ in seqs]
    plan = plan_attention(tables, lens, qsl, block_size, native=True, chunk_min_rows=chunk_min_rows)
    assert not plan.prefills and not plan.decode_groups
    chunked = [s for s, (_, q_len) in enumerate(seqs) if q_len >= chunk_min_rows]
    rows = [r for s in range(len(seqs)) if s not in chunked for r in range(qsl[s], qsl[s + 1])]
    assert plan.native_rows.rows.tolist() == rows
    if chunked:
        assert plan.native_chunks.q_starts.tolist() == [qsl[s] for s in chunked]
        assert plan.native_chunks.q_lens.tolist() == [seqs[s][1] for s in chunked]
        assert plan.native_chunks.seq_lens.tolist() == [seqs[s][0] for s in chunked]
    else:
        assert plan.native_chunks is None
    if chunk_min_rows == 100:  # every row of a chunk sees the keys up to its own
        # row 2 is the first of a 19-token prompt: it sees 1 key; row 20 the last: 19
        assert plan.native_rows.seq_lens[2] == 1 and plan.native_rows.seq_lens[20] == 19
        assert plan.native_rows.seq_lens[21] == 45 - 13 + 1  # behind a 32-token prefix
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    expected = paged_attention_ref(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32),
                                   torch.tensor(qsl, dtype=torch.int32), 0.25)
    torch.testing.assert_close(paged_attention(q, kc, vc, plan, 0.25), expected,
                               atol=ATOL, rtol=RTOL)


def test_one_thread_gives_the_same_result(ops):
    """Threads take sequences longest first as they come free; the result must not
    depend on who took which (one long context among short ones)."""
    lens = [3, 700, 17, 5, 64, 33, 2, 9]
    q, kc, vc, tables = decode_batch(11, 16, 9, 3, 64, lens)
    plan = plan_attention(tables, lens, list(range(len(lens) + 1)), 16, native=True)
    many = paged_attention(q, kc, vc, plan, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = paged_attention(q, kc, vc, plan, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)
    torch.testing.assert_close(many, reference(q, kc, vc, tables, lens, 0.125), atol=ATOL, rtol=RTOL)


def test_rows_not_named_are_left_alone(ops):
    lens = [9, 30]
    q, kc, vc, tables = decode_batch(2, 4, 4, 2, 16, lens)
    q_all = torch.randn(4, 4, 16)
    q_all[1], q_all[3] = q[0], q[1]
    out = torch.full((4, 4, 16), 7.0)
    bt = torch.tensor([t + [0] * (8 - len(t)) for t in tables], dtype=torch.int32)
    ops.paged_decode_attention(out, q_all, kc, vc, torch.tensor([1, 3]), bt,
                               torch.tensor(lens, dtype=torch.int32), 0.25)
    assert (out[0] == 7).all() and (out[2] == 7).all()
    torch.testing.assert_close(out[[1, 3]], reference(q, kc, vc, tables, lens, 0.25),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"].double()), "float32"),
    (lambda a: a.update(seq_lens=torch.tensor([0], dtype=torch.int32)), "seq_len 0"),
    (lambda a: a.update(seq_lens=torch.tensor([40], dtype=torch.int32)), "more blocks"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 999]], dtype=torch.int32)), "out of range"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 1]], dtype=torch.int64)), "int32"),
    (lambda a: a.update(rows=torch.tensor([5])), "out of range"),
    (lambda a: a.update(q=torch.randn(1, 5, 16), out=torch.empty(1, 5, 16)), "multiple"),
])
def test_bad_arguments_are_refused(ops, change, message):
    args = dict(out=torch.empty(1, 4, 16), q=torch.randn(1, 4, 16),
                key_cache=torch.randn(8, 4, 2, 16), value_cache=torch.randn(8, 4, 2, 16),
                rows=torch.tensor([0]), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                seq_lens=torch.tensor([7], dtype=torch.int32))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_decode_attention(args["out"], args["q"], args["key_cache"], args["value_cache"],
                                   args["rows"], args["block_tables"], args["seq_lens"], 0.25)


def test_bench_attention_section_prints_both_kinds(ops, capsys):
    from benchmarks import bench_cpu

    assert bench_cpu.main(["attention", "--quick", "--repeats", "1"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [line for line in lines if line and line[0] in ("decode", "prefill")]
    assert [r[0] for r in rows] == ["decode", "prefill"]
    assert all(float(r[-1]) < 1e-4 for r in rows)  # max diff between kernel and torch path
