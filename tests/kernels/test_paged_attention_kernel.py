"""paged_attention (Triton) against the torch reference.

Batches come from kernels.testing.make_paged_batch: shuffled block tables, and NaN in
every cache slot and block-table padding entry the kernel must not read, so an
out-of-context read shows up as NaN in the output.

Tolerances (output vs fp32 reference): fp32 2e-5 abs/rel; fp16 5e-3; bf16 3e-2
(bf16 keeps 8 mantissa bits: one ulp at |x| in [2, 4) is 1.6e-2).
"""

import pytest
import torch

pytest.importorskip("triton")

from kernels import paged_attention, paged_attention_ref  # noqa: E402
from kernels.paged_attention_plan import choose_launch_plan, choose_num_splits  # noqa: E402
from kernels.testing import PagedBatch, make_paged_batch  # noqa: E402

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}

# (seq_len, new tokens): decode at 33; prefill chunk of 37 after a cached prefix of 63;
# plain prefill of 7; the first token of a sequence; decode at 50.
MIXED = [(33, 1), (100, 37), (7, 7), (1, 1), (50, 1)]
# long enough chunks that the launcher picks 64-row query tiles
PREFILL = [(100, 100), (70, 6), (9, 1)]
GQA = [(2, 2), (6, 2), (8, 1)]  # (num_q_heads, num_kv_heads): ratios 1, 3, 8


def build(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int, dtype: torch.dtype, device: str, seed: int = 0) -> PagedBatch:
    return make_paged_batch([s for s, _ in seqs], [q for _, q in seqs], num_q_heads, num_kv_heads,
                            head_dim, block_size, dtype, device, seed=seed)


def check_against_reference(batch: PagedBatch, **kwargs: object) -> torch.Tensor:
    out = paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.seq_lens, batch.query_start_loc, batch.scale, **kwargs)
    ref = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.seq_lens, batch.query_start_loc, batch.scale)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    num_rows = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:num_rows].float(), ref[:num_rows].float(), **TOLERANCES[batch.q.dtype])
    return out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 128])
def test_mixed_batch_fp32(block_size: int, num_q_heads: int, num_kv_heads: int, num_splits: int,
                          device: str) -> None:
    batch = build(MIXED, num_q_heads, num_kv_heads, 32, block_size, torch.float32, device)
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch_half_precision(dtype: torch.dtype, num_splits: int, device: str) -> None:
    batch = build(MIXED, 6, 2, 32, 16, dtype, device, seed=1)
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_long_prefill_uses_big_query_tiles(block_size: int, dtype: torch.dtype, num_splits: int,
                                           device: str) -> None:
    batch = build(PREFILL, 6, 2, 16, block_size, dtype, device, seed=2)
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 128])
def test_head_dims_including_non_powers_of_two(head_dim: int, device: str) -> None:
    batch = build([(20, 1), (37, 5)], 4, 2, head_dim, 16, torch.float32, device, seed=3)
    check_against_reference(batch, num_splits=2 if head_dim == 80 else 1)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])  # 40 splits > key tiles: empty splits
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(3, 1), (8, 1)])
def test_long_decodes_split_kv(num_q_heads: int, num_kv_heads: int, num_splits: int, device: str) -> None:
    batch = build([(129, 1), (300, 1)], num_q_heads, num_kv_heads, 16, 16, torch.float32, device, seed=4)
    check_against_reference(batch, num_splits=num_splits)


def test_group_wider_than_a_16_row_tile(device: str) -> None:
    """32 query heads per KV head: a tile is one token of the whole group (block_q 1)."""
    batch = build([(40, 1), (23, 5)], 32, 1, 16, 16, torch.float32, device, seed=13)
    check_against_reference(batch)
    check_against_reference(batch, num_splits=2)


@pytest.mark.parametrize("seq_len", [1, 7, 33, 100, 130])
def test_single_sequence_prefill_and_decode(seq_len: int, device: str) -> None:
    prefill = build([(seq_len, seq_len)], 6, 2, 16, 8, torch.float32, device, seed=seq_len)
    check_against_reference(prefill)
    decode = build([(seq_len, 1)], 6, 2, 16, 8, torch.float32, device, seed=seq_len)
    check_against_reference(decode, num_splits=3)


def test_sequence_without_new_tokens_and_padding_rows(device: str) -> None:
    """A sequence with no new tokens is skipped; q rows past query_start_loc[-1] are
    padding (e.g. for CUDA graphs) and must not disturb the real rows."""
    batch = build([(40, 3), (25, 0), (9, 2)], 6, 2, 16, 16, torch.float32, device, seed=5)
    padding = torch.randn(4, *batch.q.shape[1:], device=device)
    batch.q = torch.cat([batch.q, padding])
    for num_splits in (1, 2):
        check_against_reference(batch, num_splits=num_splits)


def test_strided_q_and_out_argument(device: str) -> None:
    """q may be a view into a fused qkv projection (row stride > heads * dim)."""
    batch = build(MIXED, 6, 2, 32, 16, torch.float32, device, seed=6)
    num_tokens = batch.q.shape[0]
    qkv = torch.randn(num_tokens, 6 + 2 + 2, 32, device=device)
    qkv[:, :6] = batch.q
    batch.q = qkv[:, :6]
    assert not batch.q.is_contiguous()
    out = torch.full((num_tokens, 6, 32), float("nan"), device=device)
    returned = check_against_reference(batch, out=out)
    assert returned is out


def test_kernel_is_not_compared_with_itself(device: str) -> None:
    """The comparison can fail: corrupting one key the first sequence reads changes the output."""
    batch = build([(33, 1)], 2, 2, 16, 16, torch.float32, device, seed=7)
    before = paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                             batch.seq_lens, batch.query_start_loc, batch.scale)
    first_block = int(batch.block_tables[0, 0])
    batch.key_cache[first_block, 3] += 5.0
    after = paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                            batch.seq_lens, batch.query_start_loc, batch.scale)
    assert not torch.allclose(before, after, atol=1e-3)
    check_against_reference(batch)


def test_auto_split_choice() -> None:
    # few long decodes on a 132-SM GPU: split the context
    assert choose_num_splits(num_q_tiles=2, num_kv_heads=8, max_seq_len=32768, num_sms=132) > 1
    # the split count never makes slices shorter than 256 keys
    assert choose_num_splits(num_q_tiles=1, num_kv_heads=8, max_seq_len=512, num_sms=132) == 2
    # short contexts and big batches: no split
    assert choose_num_splits(num_q_tiles=1, num_kv_heads=8, max_seq_len=200, num_sms=132) == 1
    assert choose_num_splits(num_q_tiles=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1


def test_launch_plan_groups_query_heads_and_respects_forced_splits() -> None:
    decode = choose_launch_plan(4, 4, 32, 8, 128, torch.bfloat16, 8192, 1, 132, None)
    assert decode.group_pad == 4 and decode.block_m == 16
    assert decode.num_splits > 1
    prefill = choose_launch_plan(4096, 2, 32, 8, 128, torch.bfloat16, 8192, 4000, 132, None)
    assert prefill.block_m == 64 and prefill.num_splits == 1
    forced = choose_launch_plan(4, 4, 9, 3, 64, torch.float32, 100, 1, 132, 7)
    assert forced.num_splits == 7 and forced.group_pad == 4
    # 32 query heads per KV head: one tile holds one token's whole group
    wide_group = choose_launch_plan(4, 4, 32, 1, 64, torch.bfloat16, 100, 1, 132, None)
    assert wide_group.block_q == 1 and wide_group.block_m == 32
    # head_dim 256 keeps 16-row tiles even for prefill (a 64-row accumulator spills)
    big_head = choose_launch_plan(512, 1, 8, 8, 256, torch.bfloat16, 512, 512, 132, None)
    assert big_head.block_m == 16


def test_reference_matches_sdpa_on_contiguous_data() -> None:
    """The reference itself, against torch's SDPA on the same K/V laid out contiguously."""
    batch = make_paged_batch([45, 12], [45, 4], 6, 2, 16, 8, torch.float32, seed=8)
    ref = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.seq_lens, batch.query_start_loc, batch.scale)
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[starts[s]:starts[s + 1]]  # [q_len, 6, 16]
        q_len, seq_len = q.shape[0], k.shape[0]
        visible = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(3, dim=1).transpose(0, 1),
            v.repeat_interleave(3, dim=1).transpose(0, 1), attn_mask=visible, scale=batch.scale,
        ).transpose(0, 1)
        torch.testing.assert_close(ref[starts[s]:starts[s + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_llama8b_shapes_on_gpu(dtype: torch.dtype, num_splits: int | None) -> None:
    """Realistic sizes, compiled: 32 query / 8 KV heads, head_dim 128, block 16; a batch
    with a 1k-token chunk after a 3k prefix, a plain 500-token prefill, long decodes."""
    seqs = [(4096, 1024), (500, 500), (8191, 1), (2049, 1), (17, 1), (1, 1)]
    batch = build(seqs, 32, 8, 128, 16, dtype, "cuda", seed=9)
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [1, 8, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_block_sizes_and_head_dims_on_gpu(block_size: int, head_dim: int) -> None:
    seqs = [(1000, 300), (777, 1), (64, 64), (3, 1)]
    batch = build(seqs, 9, 3, head_dim, block_size, torch.bfloat16, "cuda", seed=10)
    check_against_reference(batch)
    check_against_reference(batch, num_splits=4)


def valid_args() -> dict[str, object]:
    batch = build([(9, 2), (5, 1)], 4, 2, 16, 4, torch.float32, "cpu", seed=11)
    return {"q": batch.q, "key_cache": batch.key_cache, "value_cache": batch.value_cache,
            "block_tables": batch.block_tables, "seq_lens": batch.seq_lens,
            "query_start_loc": batch.query_start_loc, "scale": batch.scale}


def same_wrong_cache(make):
    def mutate(args: dict) -> None:
        args["key_cache"] = make(args["key_cache"])
        args["value_cache"] = make(args["value_cache"])
    return mutate


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(q=a["q"][0]), "q must be 3-D"),
    (lambda a: a.update(q=a["q"].half()), "must have the same dtype"),
    (same_wrong_cache(lambda c: c.double()), "must have the same dtype"),
    (lambda a: a.update(q=a["q"].double(), key_cache=a["key_cache"].double(),
                        value_cache=a["value_cache"].double()), "q must have dtype"),
    (lambda a: a.update(value_cache=a["value_cache"][:, :2]), "value_cache shape"),
    (same_wrong_cache(lambda c: c[..., :8].contiguous()), r"key_cache.shape\[3\] must equal"),
    (same_wrong_cache(lambda c: torch.zeros(*c.shape[:2], 3, c.shape[3])), r"num_q_heads \(4\) must be a multiple"),
    (lambda a: a.update(q=torch.zeros(3, 5, 16)), r"must be a multiple of num_kv_heads \(2\)"),
    (same_wrong_cache(lambda c: torch.zeros(c.shape[0], 3, *c.shape[2:])), "block_size .* power of two"),
    (same_wrong_cache(lambda c: c.transpose(0, 1).contiguous().transpose(0, 1)), "must be contiguous"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous last dimension"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must have dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must have dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens.shape\[0\] must equal"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), r"query_start_loc.shape\[0\] must equal"),
    (lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables must be 2-D"),
    (lambda a: a.update(out=torch.empty(2, 4, 16)), "out must be a contiguous"),
    (lambda a: a.update(num_splits=0), "num_splits must be in"),
])
def test_launcher_rejects_bad_arguments(mutate, message: str) -> None:
    args = valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def test_head_dim_over_256_is_refused() -> None:
    batch = make_paged_batch([3], [1], 2, 2, 272, 4, torch.float32, seed=12)
    with pytest.raises(ValueError, match="head_dim must be in 1..256"):
        paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                        batch.seq_lens, batch.query_start_loc, batch.scale)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        paged_attention(**valid_args())


@pytest.mark.parametrize("block_size,num_splits", [(4, 1), (16, 3)])
@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (16, 2.5), (None, 4.0),
                                            (1000, None)])
def test_sliding_window_and_soft_capped_scores(block_size: int, window, softcap, num_splits: int,
                                               device: str) -> None:
    """Sliding-window layers (Mistral, Gemma's local ones) and Gemma 2's soft-capped
    scores, against the reference; blocks wholly before a sequence's window are filled
    with NaN after the reference ran, so a kernel that reads them fails (they may have
    been given back to the pool)."""
    batch = build(MIXED + [(70, 6)], 6, 2, 32, block_size, torch.float32, device, seed=4)
    ref = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                              batch.seq_lens, batch.query_start_loc, batch.scale,
                              window=window, softcap=softcap)
    if window:
        qsl, tables = batch.query_start_loc.tolist(), batch.block_tables.tolist()
        for s, seq_len in enumerate(batch.seq_lens.tolist()):
            first = seq_len - (qsl[s + 1] - qsl[s]) - window + 1  # the first row's reach
            for b in range(max(first, 0) // block_size):
                batch.key_cache[tables[s][b]] = float("nan")
                batch.value_cache[tables[s][b]] = float("nan")
    out = paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.seq_lens, batch.query_start_loc, batch.scale,
                          num_splits=num_splits, window=window, softcap=softcap)
    rows = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:rows], ref[:rows], **TOLERANCES[torch.float32])
    plain = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                                batch.seq_lens, batch.query_start_loc, batch.scale)
    if softcap or (window and window < 16):  # the option changes the answer
        assert not torch.allclose(out[:rows], plain[:rows].nan_to_num(), atol=1e-3)
