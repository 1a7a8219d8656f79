"""kernels/gate_up_act.py (the gated MLP's gate/up projection and activation in one
Triton launch) against torch, and TritonOps.gate_up_act, which uses it at decode sizes.

The reference is x @ weight_t (+ bias), then act(gate) * up, in float32 and rounded to
the dtype once, which is the kernel's arithmetic: bfloat16 results may differ from it by
one rounding (the accumulation order). The model's torch path rounds the product, the
activation and the result, so in bfloat16 the kernel is compared with it within a few
units in the last place; in float32 both agree to accumulation order. The interpreter's
tiles are 16 rows x 32 columns x 32 of the reduction: the sizes here are not multiples
of them.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from engine.model.ops.torch_ops import TorchOps, activation  # noqa: E402
from engine.model.ops.triton_ops import GATE_UP_FUSED_MAX_ROWS, TritonOps  # noqa: E402
from engine.model.transformer import Linear  # noqa: E402
from kernels.gate_up_act import gate_up_act  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
ACTS = ["silu", "gelu_pytorch_tanh"]


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def operands(rows: int, k: int, n: int, bias: bool, dtype: torch.dtype, device: str):
    """x [rows, k], weight_t [k, 2n] scaled so that the products are about 1, bias [2n]
    of the same size (or None)."""
    x = randn(rows, k, dtype=dtype, device=device, seed=1)
    w = randn(k, 2 * n, dtype=dtype, device=device, seed=2, scale=k ** -0.5)
    b = randn(2 * n, dtype=dtype, device=device, seed=3) if bias else None
    return x, w, b


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, name: str) -> torch.Tensor:
    """act(x @ W_gate + b_gate) * (x @ W_up + b_up) in float32, rounded to x's dtype once."""
    product = x.float() @ w.float()
    if b is not None:
        product += b.float()
    gate, up = product.split(w.shape[1] // 2, dim=-1)
    return (activation(name, gate) * up).to(x.dtype)


def model_path(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, name: str) -> torch.Tensor:
    """TorchOps.gate_up_act's arithmetic: the product and the activation rounded to the dtype."""
    product = torch.mm(x, w) if b is None else torch.addmm(b, x, w)
    gate, up = product.split(w.shape[1] // 2, dim=-1)
    return activation(name, gate).mul_(up)


def close(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    """Within `ulps` units in the last place at 1.0 of bfloat16/float16, 1e-5 for float32."""
    dtype = expected.dtype
    tol = 1e-5 if dtype == torch.float32 else ulps * torch.finfo(dtype).eps
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 100, 72), (17, 70, 40), (37, 33, 97)])
def test_gate_up_act_matches_torch(rows: int, k: int, n: int, bias: bool, name: str,
                                   dtype: torch.dtype, device: str) -> None:
    x, w, b = operands(rows, k, n, bias, dtype, device)
    out = gate_up_act(x, w, b, name)
    assert out.dtype == dtype and out.shape == (rows, n)
    close(out, reference(x, w, b, name), ulps=1)
    close(out, model_path(x, w, b, name), ulps=3)


def test_gate_up_act_reads_strided_rows_and_a_slice_of_columns(device: str) -> None:
    """x whose rows are further apart than its width, and a weight whose rows are too
    (a view of a wider tensor): the kernel follows the strides, not the shapes."""
    wide_x = randn(5, 80, dtype=torch.float32, device=device, seed=4)
    wide_w = randn(48, 100, dtype=torch.float32, device=device, seed=5, scale=0.2)
    x, w = wide_x[:, :48], wide_w[:, :66]
    close(gate_up_act(x, w, None, "silu"), reference(x.contiguous(), w.contiguous(), None, "silu"), 1)


def test_gate_up_act_of_no_rows_is_empty(device: str) -> None:
    x, w, b = operands(0, 16, 8, True, torch.float32, device)
    assert gate_up_act(x, w, b, "silu").shape == (0, 8)


def test_gate_up_act_rejects_what_it_cannot_compute() -> None:
    x, w, b = operands(3, 16, 8, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        gate_up_act(x, w, b, "relu")
    with pytest.raises(ValueError, match="even number"):
        gate_up_act(x, w[:, :15], None, "silu")
    with pytest.raises(ValueError, match=r"weight_t.shape\[0\] must equal x.shape\[1\]"):
        gate_up_act(x, w[:15], b, "silu")
    with pytest.raises(ValueError, match=r"bias.shape\[0\] must equal weight_t.shape\[1\]"):
        gate_up_act(x, w, b[:8], "silu")
    with pytest.raises(ValueError, match="must have the same dtype"):
        gate_up_act(x, w.to(torch.bfloat16), None, "silu")
    with pytest.raises(ValueError, match="x must be 2-D"):
        gate_up_act(x[0], w, b, "silu")
    with pytest.raises(ValueError, match="contiguous last dimension"):
        gate_up_act(x, w.t().contiguous().t(), b, "silu")
    with pytest.raises(ValueError, match="must have dtype in"):
        gate_up_act(x.to(torch.int32), w, b, "silu")


def feed_forward(k: int, n: int, name: str, dtype: torch.dtype, device: str) -> SimpleNamespace:
    """What TritonOps.gate_up_act reads of a FeedForward: its gate/up Linear (gate
    columns first), the intermediate size and the activation."""
    x, w, b = operands(1, k, n, True, dtype, device)
    linear = Linear(k, 2 * n, bias=True).to(dtype=dtype, device=device)
    with torch.no_grad():
        linear.weight_t.copy_(w)
        linear.bias.copy_(b)
    return SimpleNamespace(w_gate_up=linear, intermediate_size=n, activation=name)


@pytest.mark.parametrize("rows", [1, GATE_UP_FUSED_MAX_ROWS, GATE_UP_FUSED_MAX_ROWS + 1])
def test_triton_ops_fuse_the_gate_up_product_up_to_the_bound(rows: int, device: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to GATE_UP_FUSED_MAX_ROWS rows the fused kernel runs; past it the product and
    gated_act. Both match TorchOps, the model's reference path."""
    ops = TritonOps()
    launches: list[int] = []
    fused = ops._gate_up_act.gate_up_act

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        launches.append(x.shape[0])
        return fused(x, *args)

    monkeypatch.setattr(ops._gate_up_act, "gate_up_act", counting)
    ffn = feed_forward(40, 24, "gelu_pytorch_tanh", torch.bfloat16, device)
    x = randn(rows, 40, dtype=torch.bfloat16, device=device, seed=6)
    with torch.inference_mode():
        out = ops.gate_up_act(x, ffn)
        expected = TorchOps().gate_up_act(x, ffn)
    assert launches == ([rows] if rows <= GATE_UP_FUSED_MAX_ROWS else [])
    close(out, expected, ulps=3)


def test_triton_ops_keep_torch_for_an_activation_the_kernels_do_not_know(device: str) -> None:
    ffn = feed_forward(16, 8, "relu", torch.float32, device)
    x = randn(2, 16, dtype=torch.float32, device=device, seed=7)
    with pytest.raises(ValueError, match="^unknown activation 'relu'$"):  # torch's, not the kernel's
        TritonOps().gate_up_act(x, ffn)
