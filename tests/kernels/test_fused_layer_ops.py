"""The fused Triton ops of a layer (kernels/norm.py, gated_act.py, rope_store_kv.py)
against the model's torch path (engine/model/ops/torch_ops.py), which they replace on the Triton
path: odd sizes, every dtype, Gemma's norm offset, padding slots and fp8 caches."""

import pytest
import torch

pytest.importorskip("triton")

from engine.model.ops.torch_ops import activation, apply_rope, rms_norm  # noqa: E402
from kernels.fp8 import FP8_DTYPES  # noqa: E402
from kernels.gated_act import gated_act  # noqa: E402
from kernels.norm import add_rms_norm  # noqa: E402
from kernels.norm import rms_norm as rms_norm_kernel  # noqa: E402
from kernels.reference import reshape_and_cache_ref  # noqa: E402
from kernels.rope_store_kv import rope_store_kv  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulps(dtype: torch.dtype) -> float:
    """One unit in the last place at 1.0: results may differ by rounding once."""
    return torch.finfo(dtype).eps


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2 * ulps(dtype) if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,offset", [(1, 64, 0.0), (7, 576, 0.0), (5, 100, 1.0), (3, 1000, 0.0)])
def test_rms_norm_matches_the_model(rows: int, cols: int, offset: float, dtype: torch.dtype,
                                    device: str) -> None:
    x = randn(rows, cols, dtype=dtype, device=device, seed=1, scale=3.0)
    w = randn(cols, dtype=dtype, device=device, seed=2)
    out = rms_norm_kernel(x, w, 1e-6, offset)
    close(out, rms_norm(x, w, 1e-6, offset), dtype)
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_updates_the_stream_and_normalises_it(dtype: torch.dtype, offset: float,
                                                           device: str) -> None:
    h = randn(9, 320, dtype=dtype, device=device, seed=3)
    delta = randn(9, 320, dtype=dtype, device=device, seed=4)
    w = randn(320, dtype=dtype, device=device, seed=5)
    expected_h = h.clone().add_(delta)
    expected = rms_norm(expected_h, w, 1e-5, offset)
    out = add_rms_norm(h, delta, w, 1e-5, offset)
    assert torch.equal(h, expected_h), "the residual stream is h + delta, rounded as torch rounds"
    close(out, expected, dtype)


def test_rms_norm_of_a_strided_view_reads_only_its_rows(device: str) -> None:
    """A view whose rows are further apart than its width (a slice of a wider tensor)."""
    wide = randn(4, 96, dtype=torch.float32, device=device, seed=6)
    x = wide[:, :64]
    w = randn(64, dtype=torch.float32, device=device, seed=7)
    close(rms_norm_kernel(x, w, 1e-6), rms_norm(x.contiguous(), w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,n", [(1, 32), (6, 1536), (3, 1100)])
def test_gated_act_matches_the_model(rows: int, n: int, name: str, dtype: torch.dtype,
                                     device: str) -> None:
    x = randn(rows, 2 * n, dtype=dtype, device=device, seed=8, scale=2.0)
    gate, up = x.split(n, dim=-1)
    expected = activation(name, gate).mul_(up)
    close(gated_act(x, name), expected, dtype)


def test_gated_act_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        gated_act(torch.zeros(2, 8), "relu")
    with pytest.raises(ValueError, match="even number"):
        gated_act(torch.zeros(2, 7), "silu")


def rope_table(positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[T, head_dim / 2] complex rotations, as a model's table rows."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions.float()[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def torch_path(qkv, rope, key_cache, value_cache, slots, H, Hkv, k_scale=None, v_scale=None):
    """What the model's torch path does: RoPE on q and k, then reshape_and_cache."""
    T, D = qkv.shape[0], key_cache.shape[3]
    qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), rope[:, None, :])
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    reshape_and_cache_ref(qk[:, H:].cpu(), v.cpu(), key_cache, value_cache, slots.cpu(), k_scale, v_scale)
    return qk[:, :H]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D,block_size", [(9, 3, 64, 16), (4, 4, 24, 5), (8, 1, 80, 1)])
def test_rope_store_kv_matches_rope_then_reshape_and_cache(H: int, Hkv: int, D: int, block_size: int,
                                                           dtype: torch.dtype, device: str) -> None:
    T, num_blocks = 11, 40 // block_size + 1  # slots up to 20, and the last one
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype, device=device, seed=9)
    positions = torch.tensor([0, 1, 2, 3, 4, 50, 51, 52, 700, 701, 3])
    rope = rope_table(positions, D)
    slots = torch.tensor([0, 1, 2, 3, -1, 9, 10, 11, 20, num_blocks * block_size - 1, -1])
    key_cache = torch.zeros(num_blocks, block_size, Hkv, D, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    exp_k, exp_v = key_cache.cpu().clone(), value_cache.cpu().clone()
    expected_q = torch_path(qkv.cpu(), rope, exp_k, exp_v, slots, H, Hkv)
    cos_sin = torch.view_as_real(rope).contiguous().to(device)
    q = rope_store_kv(qkv, cos_sin, key_cache, value_cache, slots.to(device), H, Hkv)
    close(q, expected_q, dtype)
    close(key_cache, exp_k, dtype)
    assert torch.equal(value_cache.cpu(), exp_v), "v is copied as it is"
    # independent of the reference: padding wrote nothing, position 0 is not rotated
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not key_cache.view(-1, Hkv, D)[untouched.to(device)].any()
    close(q[0], qkv[0, :H * D].view(H, D), dtype)


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_rope_store_kv_into_an_fp8_cache_rounds_as_torch(fp8: str, device: str) -> None:
    H, Hkv, D, T = 4, 2, 32, 6
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=torch.bfloat16, device=device, seed=10, scale=4.0)
    rope = rope_table(torch.arange(T) * 7, D)
    slots = torch.tensor([3, 0, -1, 5, 6, 1])
    key_cache = torch.zeros(2, 4, Hkv, D, dtype=FP8_DTYPES[fp8], device=device)
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.tensor([0.5, 2.0], device=device)
    v_scale = torch.tensor([1.5, 0.25], device=device)
    exp_k, exp_v = key_cache.cpu().clone(), value_cache.cpu().clone()
    expected_q = torch_path(qkv.cpu(), rope, exp_k, exp_v, slots, H, Hkv, k_scale.cpu(), v_scale.cpu())
    q = rope_store_kv(qkv, torch.view_as_real(rope).contiguous().to(device), key_cache, value_cache,
                      slots.to(device), H, Hkv, k_scale, v_scale)
    close(q, expected_q, torch.bfloat16)
    # the rotated k may differ from torch's by one bf16 rounding, which fp8 rounds away
    # or keeps: compare the stored values within one fp8 step of their scale
    step = 2 ** -3 if fp8 == "fp8_e4m3" else 2 ** -2
    got, want = key_cache.cpu().float(), exp_k.float()
    assert torch.all((got - want).abs() <= step * want.abs().clamp(min=1.0) + 1e-6)
    assert torch.equal(value_cache.cpu().view(torch.uint8), exp_v.view(torch.uint8))


def test_rope_store_kv_checks_its_shapes() -> None:
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="not \\(num_heads \\+ 2 \\* num_kv_heads\\) \\* head_dim"):
        rope_store_kv(torch.zeros(3, 40), torch.zeros(3, 4, 2), cache, cache.clone(),
                      torch.zeros(3, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="cos_sin shape"):
        rope_store_kv(torch.zeros(3, 48), torch.zeros(3, 3, 2), cache, cache.clone(),
                      torch.zeros(3, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="k_scale/v_scale are for an fp8 cache"):
        rope_store_kv(torch.zeros(3, 48), torch.zeros(3, 4, 2), cache, cache.clone(),
                      torch.zeros(3, dtype=torch.int64), 2, 2, torch.ones(2), torch.ones(2))
