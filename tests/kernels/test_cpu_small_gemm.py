"""packed_linear (kernels/csrc/small_gemm.cpp) against x @ w_t computed in float64.

Tolerance: rtol = atol = 1e-4 on outputs of magnitude ~1 (weights scaled by K**-0.5);
float32 accumulation over K <= 1536 terms stays well inside it, a wrong column, row or
missing chunk of K does not. Shapes cover the kernel's edges: rows that are not a
multiple of its row block (and more rows than one pass takes), K that is not a
multiple of its chunk, N that leaves a ragged last panel, empty dimensions, and a
prefill's many rows, which go in passes.
"""
import os
import shutil
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_ext

TOL = dict(rtol=1e-4, atol=1e-4)
ROWS = [0, 1, 2, 3, 5, 8, 13, 16, 31, 32, 33, 64, 65, 130]
# (K, N): tiny, odd, the model's shapes, a K past several chunks with a wide odd N.
SHAPES = [(1, 1), (7, 17), (17, 49), (576, 960), (1536, 576), (300, 4099)]


@pytest.fixture(scope="module")
def ops():
    if not cpu_ext.enabled():
        pytest.skip("KVOPS_CPU_KERNELS=0: the CPU kernels are turned off")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the CPU kernels with")
    return cpu_ext.ops()  # a build error fails the tests, with the compiler's message


@lru_cache(maxsize=None)
def weight(k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k * 10007 + n)
    return torch.randn(k, n, generator=gen) * max(k, 1) ** -0.5


@lru_cache(maxsize=None)
def packed_weight(k: int, n: int) -> torch.Tensor:
    return cpu_ext.ops().pack_weight(weight(k, n))


def rows_of(m: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def reference(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double() @ w_t.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_matches_float64_reference(ops, m: int, k: int, n: int) -> None:
    x = rows_of(m, k)
    out = ops.packed_linear(x, packed_weight(k, n), n, None)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, weight(k, n)), **TOL)


@pytest.mark.parametrize("m,k,n", [(449, 576, 960), (337, 1536, 577), (1000, 300, 97)])
def test_prefill_rows_in_several_passes(ops, m: int, k: int, n: int) -> None:
    """Many rows go in equal passes of at most as many rows as fit in 1 MB of L2 (455 at
    K = 576, 170 at K = 1536), with K in one chunk: here two passes, the last one short
    of a whole row block, a ragged last panel, and the bias on the direct and the
    ragged path."""
    x, bias = rows_of(m, k), torch.randn(n)
    packed = ops.pack_weight(weight(k, n))
    torch.testing.assert_close(ops.packed_linear(x, packed, n, None).double(), reference(x, weight(k, n)), **TOL)
    torch.testing.assert_close(ops.packed_linear(x, packed, n, bias).double(), reference(x, weight(k, n), bias),
                               **TOL)


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (13, 17, 49), (65, 1536, 576), (3, 7, 4099)])
def test_bias_is_added_to_every_row(ops, m: int, k: int, n: int) -> None:
    x, bias = rows_of(m, k), torch.randn(n)
    out = ops.packed_linear(x, packed_weight(k, n), n, bias)
    torch.testing.assert_close(out.double(), reference(x, weight(k, n), bias), **TOL)


@pytest.mark.parametrize("m,n", [(0, 5), (4, 5), (9, 97)])
def test_empty_k_gives_zeros_or_the_bias(ops, m: int, n: int) -> None:
    x, bias = torch.empty(m, 0), torch.randn(n)
    packed = ops.pack_weight(torch.empty(0, n))
    assert torch.equal(ops.packed_linear(x, packed, n, None), torch.zeros(m, n))
    assert torch.equal(ops.packed_linear(x, packed, n, bias), bias.expand(m, n))


def test_empty_n_gives_an_empty_output(ops) -> None:
    out = ops.packed_linear(rows_of(5, 7), ops.pack_weight(torch.empty(7, 0)), 0, None)
    assert out.shape == (5, 0)


def test_non_contiguous_inputs(ops) -> None:
    k, n = 576, 960
    wide = rows_of(13, 2 * k)
    x = wide[:, ::2]  # every other column: row stride 2K, column stride 2
    assert not x.is_contiguous()
    # the model's case: nn.Linear's weight is [N, K]; its transpose is a view
    w_t = torch.randn(n, k).t()
    bias = torch.randn(2 * n)[::2]
    out = ops.packed_linear(x, ops.pack_weight(w_t), n, bias)
    torch.testing.assert_close(out.double(), reference(x, w_t, bias), **TOL)


def test_same_result_with_one_and_two_threads(ops) -> None:
    """Threads split the columns, so each output is summed in the same order."""
    x, packed = rows_of(33, 1536), packed_weight(1536, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.packed_linear(x, packed, 576, None)
        torch.set_num_threads(2)
        two = ops.packed_linear(x, packed, 576, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 70), k=st.integers(0, 300), n=st.integers(1, 200), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_shapes(ops, m: int, k: int, n: int, with_bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, w_t, bias = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen), torch.randn(n, generator=gen)
    bias = bias if with_bias else None
    out = ops.packed_linear(x, ops.pack_weight(w_t), n, bias)
    # unscaled weights: outputs grow like sqrt(k), so does the float32 rounding
    torch.testing.assert_close(out.double(), reference(x, w_t, bias), rtol=1e-4, atol=1e-4 * max(k, 1) ** 0.5)


def test_rejects_bad_weights(ops) -> None:
    with pytest.raises(RuntimeError, match="w_t must be 2-D"):
        ops.pack_weight(torch.randn(4))
    with pytest.raises(RuntimeError, match="w_t must be float32"):
        ops.pack_weight(torch.randn(4, 4, dtype=torch.float64))


@pytest.mark.parametrize("make_args,message", [
    (lambda p: (torch.randn(3, 17, dtype=torch.float64), p, 49, None), "x must be float32"),
    (lambda p: (torch.randn(17), p, 49, None), "x must be 2-D"),
    (lambda p: (torch.randn(3, 16), p, 49, None), "x has K = 16 columns but the packed weight has K = 17"),
    (lambda p: (torch.randn(3, 17), p, 200, None), "n = 200 needs"),
    (lambda p: (torch.randn(3, 17), p, -1, None), "n = -1 needs"),
    (lambda p: (torch.randn(3, 17), torch.randn(17, 49), 49, None), "packed must be a contiguous float32"),
    (lambda p: (torch.randn(3, 17), p.double(), 49, None), "packed must be a contiguous float32"),
    (lambda p: (torch.randn(3, 17), p, 49, torch.randn(48)), "bias must be float32 \\[49\\]"),
    (lambda p: (torch.randn(3, 17), p, 49, torch.randn(49, dtype=torch.float64)), "bias must be float32"),
])
def test_rejects_bad_arguments(ops, make_args, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        ops.packed_linear(*make_args(packed_weight(17, 49)))


def test_bench_gemm_section_prints_a_row_per_row_count(ops, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_cpu

    assert bench_cpu.main(["gemm", "--rows", "1", "3", "--layers", "1", "--repeats", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["1", "3"]


# --- packed_swiglu: SwiGLU on a gate_up weight packed in panel pairs --------------------
@pytest.mark.parametrize("k,n", [(1, 1), (7, 17), (64, 48), (576, 1536), (100, 50)])
@pytest.mark.parametrize("m", [0, 1, 5, 32, 65, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_equals_packed_linear_then_silu_mul(ops, m: int, k: int, n: int,
                                                   with_bias: bool) -> None:
    """The same sums in the same order, the same activation: bit for bit the unfused
    result (so greedy tokens cannot change), and close to the float64 SwiGLU."""
    w_t = weight(k, 2 * n)
    bias = torch.randn(2 * n, generator=torch.Generator().manual_seed(n)) if with_bias else None
    x = rows_of(m, k, seed=m + n)
    fused = ops.packed_swiglu(x, ops.pack_gate_up(w_t, n), n, bias)
    unfused = ops.silu_mul(ops.packed_linear(x, ops.pack_weight(w_t), 2 * n, bias))
    assert fused.shape == (m, n)
    assert torch.equal(fused, unfused)
    gate_up = reference(x, w_t, bias)
    expected = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(fused.double(), expected, **TOL)


def test_swiglu_rejects_bad_arguments(ops) -> None:
    w_t = weight(16, 96)
    packed = ops.pack_gate_up(w_t, 48)
    with pytest.raises(RuntimeError, match="needs 6 panels of 48 columns but packed has 2"):
        ops.packed_swiglu(rows_of(2, 16), packed, 100, None)
    with pytest.raises(RuntimeError, match="K = 15"):
        ops.packed_swiglu(rows_of(2, 15), packed, 48, None)
    with pytest.raises(RuntimeError, match="gate then up"):
        ops.packed_swiglu(rows_of(2, 16), packed, 48, torch.zeros(48))
    with pytest.raises(RuntimeError, match=r"\[K, 2 \* 50\]"):
        ops.pack_gate_up(w_t, 50)
