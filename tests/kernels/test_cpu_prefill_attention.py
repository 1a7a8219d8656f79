"""kvops::paged_prefill_attention (kernels/csrc/paged_prefill_attention.cpp) against the
torch reference: chunks shorter and longer than the kernel's 16-row items, behind a
cached prefix or not, block sizes under and over its 16-key tiles, GQA ratios, head
sizes with a compiled path and without, a strided q, rows left alone, and the checks
that refuse bad arguments."""
from __future__ import annotations

import os
import random

import pytest
import torch

from kernels import cpu_ext
from kernels.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(os.environ.get("KVOPS_CPU_KERNELS") == "0",
                                reason="KVOPS_CPU_KERNELS=0 turns the CPU kernels off")

ATOL = RTOL = 2e-5  # float32 on both sides; summation order and exp() differ


@pytest.fixture(scope="module")
def ops():
    return cpu_ext.ops()


def chunk_batch(seed: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
                seqs: list[tuple[int, int]]):
    """seqs: (seq_len, q_len) per chunk. q has extra heads around it (a strided view, as
    the model passes it) and one spare row at each end that no chunk owns."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 3
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n, _ in seqs]
    qsl = [1]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1] + 1, q_heads + kv_heads, head_dim, generator=g)[:, :q_heads]
    return q, kc, vc, tables, qsl


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def run_kernel(ops, q, kc, vc, tables, qsl, seqs, scale, fill=7.0):
    out = torch.full(q.shape, fill)
    ops.paged_prefill_attention(out, q, kc, vc, torch.tensor(qsl[:-1]),
                                torch.tensor([n for _, n in seqs], dtype=torch.int32),
                                padded(tables), torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                                scale)
    return out


def reference(q, kc, vc, tables, qsl, seqs, scale):
    return paged_attention_ref(q.contiguous(), kc, vc, padded(tables),
                               torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                               torch.tensor(qsl, dtype=torch.int32), scale)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 80])
def test_chunks_match_the_reference(ops, block_size, q_heads, kv_heads, head_dim):
    """Whole prompts (seq_len == q_len) and chunks behind a prefix; q_len 1, under 16,
    16, a multiple of 16 plus some, and long."""
    seqs = [(1, 1), (7, 7), (16, 16), (37, 37), (45, 13), (100, 33), (130, 2), (257, 200)]
    q, kc, vc, tables, qsl = chunk_batch(block_size + head_dim + q_heads, block_size, q_heads,
                                         kv_heads, head_dim, seqs)
    scale = head_dim ** -0.5
    got = run_kernel(ops, q, kc, vc, tables, qsl, seqs, scale)
    expected = reference(q, kc, vc, tables, qsl, seqs, scale)
    torch.testing.assert_close(got[1:-1], expected[1:-1], atol=ATOL, rtol=RTOL)
    assert (got[0] == 7).all() and (got[-1] == 7).all()  # rows no chunk owns


def test_large_scores_do_not_overflow(ops):
    seqs = [(60, 60), (90, 31)]
    q, kc, vc, tables, qsl = chunk_batch(3, 8, 4, 2, 32, seqs)
    got = run_kernel(ops, q * 30, kc, vc, tables, qsl, seqs, 1.0)
    expected = reference(q * 30, kc, vc, tables, qsl, seqs, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[1:-1], expected[1:-1], atol=1e-4, rtol=1e-4)


def test_one_thread_gives_the_same_result(ops):
    """Items are handed out to threads as they come free; the result must not depend on
    who took which."""
    seqs = [(300, 300), (50, 20)]
    q, kc, vc, tables, qsl = chunk_batch(4, 16, 9, 3, 64, seqs)
    many = run_kernel(ops, q, kc, vc, tables, qsl, seqs, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_kernel(ops, q, kc, vc, tables, qsl, seqs, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"].double()), "float32"),
    (lambda a: a.update(q_lens=torch.tensor([0], dtype=torch.int32)), "q_len 0"),
    (lambda a: a.update(q_lens=torch.tensor([9], dtype=torch.int32)), "q_len 9"),
    (lambda a: a.update(q_starts=torch.tensor([3])), "out of range"),
    (lambda a: a.update(seq_lens=torch.tensor([40], dtype=torch.int32)), "more blocks"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 999]], dtype=torch.int32)), "out of range"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 1]], dtype=torch.int64)), "int32"),
    (lambda a: a.update(q_lens=torch.tensor([2, 2], dtype=torch.int32)), "one entry per chunk"),
    (lambda a: a.update(q=torch.randn(4, 5, 16), out=torch.empty(4, 5, 16)), "multiple"),
])
def test_bad_arguments_are_refused(ops, change, message):
    args = dict(out=torch.empty(4, 4, 16), q=torch.randn(4, 4, 16),
                key_cache=torch.randn(8, 4, 2, 16), value_cache=torch.randn(8, 4, 2, 16),
                q_starts=torch.tensor([0]), q_lens=torch.tensor([4], dtype=torch.int32),
                block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                seq_lens=torch.tensor([7], dtype=torch.int32))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_prefill_attention(args["out"], args["q"], args["key_cache"], args["value_cache"],
                                    args["q_starts"], args["q_lens"], args["block_tables"],
                                    args["seq_lens"], 0.25)
