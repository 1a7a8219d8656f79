"""kernels/csrc/fused_ops.cpp against the torch code it replaces (engine/model/transformer.py's
RMSNorm, SwiGLU gating, apply_rope and the backend's K/V store), on odd sizes, and the
checks that refuse bad arguments."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.model.transformer import RMSNorm
from engine.model.ops.torch_ops import apply_rope
from kernels import cpu_ext

pytestmark = pytest.mark.skipif(os.environ.get("KVOPS_CPU_KERNELS") == "0",
                                reason="KVOPS_CPU_KERNELS=0 turns the CPU kernels off")


@pytest.fixture(scope="module")
def ops():
    return cpu_ext.ops()


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    return norm(x)


@pytest.mark.parametrize("rows,dim", [(1, 1), (3, 17), (64, 576), (257, 100)])
def test_rms_norm(ops, rows, dim):
    x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("rows,dim", [(1, 5), (33, 576), (300, 64)])
def test_add_rms_norm_updates_the_residual(ops, rows, dim):
    h, delta, w = torch.randn(rows, dim), torch.randn(rows, dim), torch.randn(dim)
    expected_h = h + delta
    got = ops.add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(h, expected_h)  # in place, exactly the sum
    torch.testing.assert_close(got, torch_rms_norm(expected_h, w, 1e-6))


@pytest.mark.parametrize("rows,inter", [(1, 1), (5, 15), (40, 1536), (2, 33)])
def test_silu_mul(ops, rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 8  # wide range: both tails of the sigmoid
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=2e-6)


def test_silu_mul_extremes(ops):
    gate_up = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1, 2, 3, 4, 5]])
    gate, up = gate_up.split(5, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 1),
                                                                (6, 2, 32, 4), (8, 1, 80, 8)])
def test_rope_store_kv(ops, heads, kv_heads, head_dim, block_size):
    T, num_blocks = 11, 20
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim)
    freqs = torch.rand(T, head_dim // 2) * 50
    rope = torch.polar(torch.ones_like(freqs), freqs)  # [T, D/2] complex, as the model's
    kv = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:T]
    q = ops.rope_store_kv(qkv, torch.view_as_real(rope).contiguous(), kv, slots, heads, kv_heads)

    D = head_dim
    qk = apply_rope(qkv[:, :(heads + kv_heads) * D].view(T, heads + kv_heads, D), rope[:, None])
    v = qkv[:, (heads + kv_heads) * D:].view(T, kv_heads, D)
    torch.testing.assert_close(q, qk[:, :heads], rtol=1e-5, atol=1e-5)
    flat = kv.view(2, -1, kv_heads, D)
    torch.testing.assert_close(flat[0, slots], qk[:, heads:], rtol=1e-5, atol=1e-5)
    assert torch.equal(flat[1, slots], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert (flat[:, untouched] == 0).all()


@pytest.mark.parametrize("call,message", [
    (lambda o: o.rms_norm(torch.randn(2, 3).double(), torch.randn(3), 1e-5), "float32"),
    (lambda o: o.rms_norm(torch.randn(2, 3), torch.randn(4), 1e-5), "weight"),
    (lambda o: o.add_rms_norm(torch.randn(2, 3), torch.randn(3, 3), torch.randn(3), 1e-5),
     "differ in shape"),
    (lambda o: o.silu_mul(torch.randn(2, 3)), "even"),
    (lambda o: o.rope_store_kv(torch.randn(1, 5 * 4), torch.randn(1, 2, 2),
                               torch.zeros(2, 2, 2, 1, 4), torch.tensor([9]), 3, 1), "out of range"),
    (lambda o: o.rope_store_kv(torch.randn(1, 5 * 4), torch.randn(1, 2, 2),
                               torch.zeros(2, 2, 2, 2, 4), torch.tensor([0]), 3, 1), "kv heads"),
])
def test_bad_arguments_are_refused(ops, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(ops)
