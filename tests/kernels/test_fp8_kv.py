"""FP8 K/V caches: the Triton kernels (in the interpreter without a GPU) and the torch
path against torch's own casts.

* reshape_and_cache quantises bit for bit as torch does: x / scale, clamped to the
  format's largest value, cast (round to nearest even): every fp8 value, the ties
  between neighbours, subnormals, signed zeros, saturation, per-head scales;
* paged_attention over an fp8 cache equals the fp32 reference over the dequantised
  cache (the kernel reads exactly those values), with NaN in every slot it must not
  read (the poison survives quantisation as fp8 NaN);
* the torch path (kernels/cpu_attention.py) does the same.
"""

import pytest
import torch

pytest.importorskip("triton")

from kernels import paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from kernels.cpu_attention import windowed_attention  # noqa: E402
from kernels.cpu_attention import paged_attention as torch_paged_attention  # noqa: E402
from kernels.cpu_attention import plan_attention  # noqa: E402
from kernels.fp8 import FP8_GRID, dequantize, quantize, scales_for  # noqa: E402
from kernels.reference import dequantize_cache_ref  # noqa: E402
from kernels.testing import make_paged_batch  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def every_value_and_tie(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), and
    points just either side of each midpoint, both signs, as float32."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    values = codes[torch.isfinite(codes)].unique().sort().values
    mids = (values[1:] + values[:-1]) / 2
    eps = torch.nextafter(mids, torch.full_like(mids, float("inf"))) - mids
    top = FP8_GRID[dtype][0]
    extra = torch.tensor([0.0, -0.0, top * 1.01, top * 4, -top * 4, 1e-12, -1e-12, 3e38])
    return torch.cat([values, mids, mids + eps, mids - eps, extra])


def run_quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype, device: str):
    """x [n, heads, dim] through the kernel and the reference; returns both caches' bytes."""
    n, heads, dim = x.shape
    caches = [torch.zeros(n, 1, heads, dim, dtype=cache_dtype, device=device) for _ in range(4)]
    slots = torch.arange(n, device=device)
    scale = scale.to(device)
    reshape_and_cache(x, x, caches[0], caches[1], slots, scale, scale)
    reshape_and_cache_ref(x.cpu(), x.cpu(), caches[2].cpu(), caches[3].cpu(), slots.cpu(),
                          scale.cpu(), scale.cpu())
    return caches


@pytest.mark.parametrize("cache_dtype", FP8)
def test_every_value_and_tie_quantises_as_torch_casts(cache_dtype: torch.dtype, device: str) -> None:
    x = every_value_and_tie(cache_dtype)
    pad = -len(x) % 16
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 1, 16).to(device)
    scale = torch.ones(1)
    out = torch.zeros(x.shape[0], 1, 1, 16, dtype=cache_dtype, device=device)
    reshape_and_cache(x, x, out, out.clone(), torch.arange(x.shape[0], device=device), scale.to(device),
                      scale.to(device))
    top = FP8_GRID[cache_dtype][0]
    expected = x.cpu().clamp(-top, top).to(cache_dtype)
    got = out.view(x.shape).cpu()
    mismatched = (got.view(torch.uint8) != expected.view(torch.uint8)).nonzero()
    assert len(mismatched) == 0, [(float(x.cpu()[tuple(i)]), float(got[tuple(i)]), float(expected[tuple(i)]))
                                  for i in mismatched[:5]]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim", [(1, 16), (3, 80), (4, 64)])
def test_reshape_and_cache_matches_torch_casts(cache_dtype, dtype, heads, dim, device) -> None:
    gen = torch.Generator().manual_seed(heads * dim)
    x = (torch.randn(23, heads, dim, generator=gen) * torch.logspace(-4, 3, dim)).to(dtype)
    scale = torch.tensor([0.37, 1.0, 8.0, 0.0625][:heads])  # odd and power-of-two scales
    k, v, k_ref, v_ref = run_quantize(x.to(device), scale, cache_dtype, device)
    assert torch.equal(k.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.cpu().view(torch.uint8), v_ref.view(torch.uint8))
    # and the torch path's quantize is the same cast
    assert torch.equal(quantize(x, scale, cache_dtype).view(torch.uint8),
                       k_ref.view(x.shape).view(torch.uint8))


def test_padding_slots_and_odd_token_counts(device: str) -> None:
    x = torch.randn(7, 2, 24, device=device)
    cache = torch.zeros(4, 4, 2, 24, dtype=torch.float8_e4m3fn, device=device)
    before = cache.clone()
    slots = torch.tensor([-1, 3, -1, 15, 4, -1, 0], device=device)
    scale = torch.ones(2, device=device)
    reshape_and_cache(x, x, cache, cache.clone(), slots, scale, scale)
    flat = cache.view(16, 2, 24).cpu()
    for tok, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot].view(torch.uint8),
                               x[tok].cpu().to(torch.float8_e4m3fn).view(torch.uint8))
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert torch.equal(flat[untouched].view(torch.uint8), before.view(16, 2, 24)[untouched].cpu().view(torch.uint8))


def test_scales_are_checked(device: str) -> None:
    x = torch.randn(2, 2, 16, device=device)
    fp8 = torch.zeros(1, 4, 2, 16, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.arange(2, device=device)
    with pytest.raises(ValueError, match="needs k_scale"):
        reshape_and_cache(x, x, fp8, fp8.clone(), slots)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(x, x, fp8, fp8.clone(), slots, torch.ones(3, device=device),
                          torch.ones(3, device=device))
    plain = torch.zeros(1, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="for an fp8 cache"):
        reshape_and_cache(x, x, plain, plain.clone(), slots, torch.ones(2, device=device),
                          torch.ones(2, device=device))


def fp8_batch(seqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, device,
              per_head=True):
    """A make_paged_batch batch (NaN in every slot not to be read) with its caches
    quantised to cache_dtype, and the scales and dequantised caches of the reference."""
    batch = make_paged_batch([s for s, _ in seqs], [q for _, q in seqs], num_q_heads, num_kv_heads,
                             head_dim, block_size, torch.float32, device)
    amax_k = batch.key_cache.nan_to_num(0).abs().amax(dim=(0, 1, 3))
    amax_v = batch.value_cache.nan_to_num(0).abs().amax(dim=(0, 1, 3))
    if not per_head:
        amax_k, amax_v = amax_k.max().expand_as(amax_k), amax_v.max().expand_as(amax_v)
    k_scale = scales_for(amax_k, cache_dtype).contiguous()
    v_scale = scales_for(amax_v, cache_dtype).contiguous()
    key_cache = quantize(batch.key_cache, k_scale, cache_dtype)  # NaN stays NaN
    value_cache = quantize(batch.value_cache, v_scale, cache_dtype)
    assert key_cache.float().isnan().any()  # the poison survived
    q = batch.q.to(dtype)
    return batch, q, key_cache, value_cache, k_scale, v_scale


def reference(batch, q, key_cache, value_cache, k_scale, v_scale, **kwargs):
    return paged_attention_ref(q.float(), dequantize_cache_ref(key_cache, k_scale),
                               dequantize_cache_ref(value_cache, v_scale), batch.block_tables,
                               batch.seq_lens, batch.query_start_loc, batch.scale, **kwargs)


TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
       torch.float16: {"atol": 5e-3, "rtol": 5e-3}}
MIXED = [(33, 1), (100, 37), (7, 7), (1, 1), (50, 1)]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(6, 2, 64), (3, 3, 80), (8, 1, 40)])
def test_paged_attention_over_fp8_matches_the_dequantised_reference(
        cache_dtype, num_splits, block_size, num_q_heads, num_kv_heads, head_dim, device) -> None:
    batch, q, k, v, ks, vs = fp8_batch(MIXED, num_q_heads, num_kv_heads, head_dim, block_size,
                                       torch.float32, cache_dtype, device)
    out = paged_attention(q, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = reference(batch, q, k, v, ks, vs)
    rows = int(batch.query_start_loc[-1])
    assert not out[:rows].isnan().any()
    torch.testing.assert_close(out[:rows], ref[:rows], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_and_a_window(dtype, device) -> None:
    batch, q, k, v, ks, vs = fp8_batch(MIXED, 4, 2, 32, 16, dtype, torch.float8_e4m3fn, device,
                                       per_head=False)
    out = paged_attention(q, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, num_splits=2, window=20, k_scale=ks, v_scale=vs)
    ref = reference(batch, q, k, v, ks, vs, window=20)
    rows = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:rows].float(), ref[:rows], **TOL[dtype])


def test_fp8_is_close_to_the_unquantised_attention(device) -> None:
    """The quantisation error itself, as the RMS of the error over the RMS of the
    output: e4m3 keeps 3 mantissa bits (a value's error up to 1/16), e5m2 2 bits (1/8)."""
    errors = {}
    for cache_dtype in FP8:
        batch, q, k, v, ks, vs = fp8_batch(MIXED, 4, 2, 64, 16, torch.float32, cache_dtype, device)
        out = paged_attention(q, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                              batch.scale, k_scale=ks, v_scale=vs)
        exact = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, batch.scale)
        rows = int(batch.query_start_loc[-1])
        errors[cache_dtype] = ((out[:rows] - exact[:rows]).pow(2).mean().sqrt()
                               / exact[:rows].pow(2).mean().sqrt()).item()
    assert 0 < errors[torch.float8_e4m3fn] < 0.04, errors
    assert errors[torch.float8_e4m3fn] < errors[torch.float8_e5m2] < 0.08, errors


@pytest.mark.parametrize("cache_dtype", FP8)
def test_torch_path_reads_fp8_as_the_kernel_does(cache_dtype) -> None:
    batch, q, k, v, ks, vs = fp8_batch(MIXED, 6, 2, 64, 16, torch.float32, cache_dtype, "cpu")
    # the torch path pads decodes with real blocks and masks scores: poison only past
    # the context in blocks it reads would not be masked for V, so clear it there
    k, v = k.clone(), v.clone()
    k.view(torch.uint8)[k.float().isnan()] = 0
    v.view(torch.uint8)[v.float().isnan()] = 0
    plan = plan_attention(batch.block_tables.tolist(), batch.seq_lens.tolist(),
                          batch.query_start_loc.tolist(), 16, "cpu")
    out = torch_paged_attention(q, k, v, plan, batch.scale, kv_scales=(ks, vs))
    ref = reference(batch, q, k, v, ks, vs)
    rows = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:rows], ref[:rows], atol=1e-5, rtol=1e-5)
    windowed = windowed_attention(q, k, v, batch.block_tables.tolist(), batch.seq_lens.tolist(),
                                  batch.query_start_loc.tolist(), batch.scale, window=9,
                                  kv_scales=(ks, vs))
    torch.testing.assert_close(windowed[:rows], reference(batch, q, k, v, ks, vs, window=9)[:rows],
                               atol=1e-5, rtol=1e-5)


def test_dequantize_and_scales() -> None:
    y = torch.tensor([[[1.0, -2.0]], [[0.5, 448.0]]]).to(torch.float8_e4m3fn)  # [2, 1 head, 2]
    assert dequantize(y, torch.tensor([0.25]), torch.float32).tolist() == [[[0.25, -0.5]], [[0.125, 112.0]]]
    scales = scales_for(torch.tensor([448.0, 100.0, 0.0, 1e-3]), torch.float8_e4m3fn)
    assert scales.tolist()[:3] == [2.0, 0.5, 1.0]  # powers of two with 2x headroom; 0 -> 1
    assert scales[3] > 0 and torch.log2(scales[3]) == torch.log2(scales[3]).round()


@pytest.mark.parametrize("cache_dtype", FP8)
def test_nan_in_stays_nan_as_torchs_cast_keeps_it(cache_dtype, device) -> None:
    x = torch.randn(4, 2, 16)
    x[1, 0, 3] = x[3, 1, 0] = float("nan")
    k, _, k_ref, _ = run_quantize(x.to(device), torch.tensor([0.5, 2.0]), cache_dtype, device)
    got, want = k.cpu().view(4, 2, 16).float(), k_ref.view(4, 2, 16).float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
