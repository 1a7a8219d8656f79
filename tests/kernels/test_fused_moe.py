"""fused_moe (Triton) and fused_moe_torch against the torch reference fused_moe_ref.

Cases come from make_moe_case: when there is more than one expert the last one gets no
tokens and its weights are NaN, so a kernel that reads the weights of an expert
nobody was routed to produces NaN. Odd sizes leave partial row, column and K tiles.

Tolerances (output vs the fp32 reference): fp32 2e-5 abs/rel; fp16 5e-3; bf16 3e-2.
The kernel and the torch path round the intermediate act(gate) * up to the input
dtype, as the dense MLP does, and the output once; one bf16 ulp at |x| in [2, 4) is
1.6e-2. On the GPU at realistic sizes fp32 gets 1e-4 (long sums in another order).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_moe, fused_moe_ref, fused_moe_torch
from kernels.fused_moe import align_pairs, choose_tiles

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
# fp32 sums of thousands of products, in another order than the reference's
GPU_TOLERANCES = {**TOLERANCES, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
ACTIVATIONS = ["silu", "gelu_pytorch_tanh"]

# (num_tokens, dim, inter, num_experts, top_k, skew); skew: every token's first expert is 0
CASES = [
    (1, 32, 16, 1, 1, False),
    (5, 48, 40, 4, 2, False),
    (5, 32, 16, 1, 2, False),  # one expert: both of a token's slots route to it
    (33, 32, 16, 8, 2, True),  # expert 0 has 33+ rows: several row blocks of one expert
    (33, 48, 40, 8, 1, False),
    (17, 96, 80, 4, 2, False),  # two column tiles in both passes, several K steps
]
LARGE_CASES = [
    (257, 96, 80, 16, 4, False),
    (300, 64, 48, 64, 8, True),
]


@dataclass(slots=True)
class MoeCase:
    x: torch.Tensor  # [num_tokens, dim]
    w_gate_up: torch.Tensor  # [num_experts, dim, 2 * inter]
    w_down: torch.Tensor  # [num_experts, inter, dim]
    topk_weights: torch.Tensor  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor  # [num_tokens, top_k]

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.w_gate_up, self.w_down, self.topk_weights, self.topk_ids


def make_moe_case(num_tokens: int, dim: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
                  device: str, seed: int = 0, skew: bool = False, ids_dtype: torch.dtype = torch.int64,
                  poison_unused: bool = True) -> MoeCase:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=gen, device=device)
    w_gate_up = torch.randn(num_experts, dim, 2 * inter, generator=gen, device=device) / dim**0.5
    w_down = torch.randn(num_experts, inter, dim, generator=gen, device=device) / inter**0.5
    routable = max(1, num_experts - 1)  # the last expert gets no tokens, if there is another
    if routable >= top_k:  # distinct experts per token, as top-k routing gives
        ids = torch.rand(num_tokens, routable, generator=gen, device=device).argsort(dim=1)[:, :top_k]
    else:
        ids = torch.randint(0, routable, (num_tokens, top_k), generator=gen, device=device)
    if skew:
        ids[:, 0] = 0
    if poison_unused and num_experts > 1:
        w_gate_up[-1] = float("nan")
        w_down[-1] = float("nan")
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen, device=device), dim=-1)
    return MoeCase(x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids.to(ids_dtype))


def check_against_reference(op, case: MoeCase, activation: str, tolerances: dict = TOLERANCES,
                            **kwargs: object) -> torch.Tensor:
    out = op(*case.args(), activation, **kwargs)
    ref = fused_moe_ref(*case.args(), activation)
    assert out.dtype == case.x.dtype and out.shape == case.x.shape
    torch.testing.assert_close(out.float(), ref.float(), **tolerances[case.x.dtype])
    return out


# --- the Triton kernel (interpreter on CPU) ---

@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("num_tokens,dim,inter,num_experts,top_k,skew", CASES)
def test_kernel_matches_reference(num_tokens: int, dim: int, inter: int, num_experts: int, top_k: int,
                                  skew: bool, activation: str, dtype: torch.dtype, device: str) -> None:
    case = make_moe_case(num_tokens, dim, inter, num_experts, top_k, dtype, device, skew=skew)
    check_against_reference(fused_moe, case, activation)


@needs_triton
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_kernel_fp16(activation: str, device: str) -> None:
    case = make_moe_case(9, 48, 40, 4, 2, torch.float16, device, seed=1)
    check_against_reference(fused_moe, case, activation)


@needs_triton
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_kernel_forced_block_m(block_m: int, device: str) -> None:
    case = make_moe_case(40, 48, 40, 5, 2, torch.float32, device, seed=2, skew=True)
    check_against_reference(fused_moe, case, "silu", block_m=block_m)


@needs_triton
def test_kernel_int32_ids_and_strided_tokens(device: str) -> None:
    """x may be a view with a row stride > dim (e.g. a slice of a wider activation)."""
    case = make_moe_case(7, 32, 16, 4, 2, torch.float32, device, seed=3, ids_dtype=torch.int32)
    wide = torch.randn(7, 80, device=device)
    wide[:, 8:40] = case.x
    case.x = wide[:, 8:40]
    assert not case.x.is_contiguous()
    check_against_reference(fused_moe, case, "silu")


@needs_triton
def test_kernel_is_not_compared_with_itself(device: str) -> None:
    """The comparison can fail: changing an expert token 0 uses changes token 0's output."""
    case = make_moe_case(6, 32, 16, 4, 2, torch.float32, device, seed=4)
    before = fused_moe(*case.args())
    case.w_down[int(case.topk_ids[0, 0])] += 1.0
    after = check_against_reference(fused_moe, case, "silu")
    assert not torch.allclose(before[0], after[0], atol=1e-3)


@needs_triton
@pytest.mark.parametrize("op", [fused_moe, fused_moe_torch])
@pytest.mark.parametrize("num_tokens,top_k", [(0, 2), (3, 0)])
def test_no_pairs_gives_zeros(op, num_tokens: int, top_k: int, device: str) -> None:
    case = make_moe_case(num_tokens, 32, 16, 4, top_k, torch.float32, device)
    out = op(*case.args())
    assert out.shape == (num_tokens, 32) and torch.equal(out, torch.zeros_like(out))


# --- the align step and tile choice ---

@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 1, 1, 16), (33, 8, 2, 16), (40, 5, 3, 32),
                                                                  (100, 64, 8, 16), (7, 3, 2, 64)])
def test_align_groups_pairs_by_expert(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    ids = make_moe_case(num_tokens, 16, 16, num_experts, top_k, torch.float32, "cpu", skew=True).topk_ids
    num_pairs = ids.numel()
    sorted_pair_ids, block_expert = align_pairs(ids, num_experts, block_m)
    assert sorted_pair_ids.shape == (block_expert.numel() * block_m,)
    real = sorted_pair_ids[sorted_pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert torch.all(sorted_pair_ids <= num_pairs)  # the rest is padding
    flat = ids.reshape(-1)
    used = block_expert[block_expert >= 0].tolist()
    assert used == sorted(used) and set(used) == set(flat.tolist())  # experts in order, no empty one
    assert torch.all(block_expert[len(used):] == -1)  # the unused tail of the grid
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_pair_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and torch.all(flat[rows.long()] == expert)
            assert torch.all(rows[1:] > rows[:-1])  # stable: token order within an expert


def test_tile_choice() -> None:
    assert choose_tiles(4 * 8, 128, torch.bfloat16).block_m == 16  # decode: a few rows per expert
    assert choose_tiles(4096 * 2, 8, torch.bfloat16).block_m == 64  # prefill
    assert choose_tiles(4096 * 2, 8, torch.float32).block_m == 32  # 64 fp32 rows spill registers
    assert choose_tiles(8, 8, torch.float32, block_m=64).block_m == 64


# --- the torch path and the reference ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("num_tokens,dim,inter,num_experts,top_k,skew", CASES + LARGE_CASES)
def test_torch_path_matches_reference(num_tokens: int, dim: int, inter: int, num_experts: int, top_k: int,
                                      skew: bool, activation: str, dtype: torch.dtype) -> None:
    case = make_moe_case(num_tokens, dim, inter, num_experts, top_k, dtype, "cpu", seed=5, skew=skew)
    check_against_reference(fused_moe_torch, case, activation)


@pytest.mark.parametrize("activation,act", [("silu", F.silu),
                                            ("gelu_pytorch_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_reference_matches_dense_formula(activation: str, act) -> None:
    """The reference itself, against every expert run on every token, weighted by a
    dense [T, E] routing matrix (zero where a token does not use the expert)."""
    case = make_moe_case(11, 24, 20, 6, 3, torch.float32, "cpu", seed=6, poison_unused=False)
    inter = case.w_down.shape[1]
    gate_up = torch.einsum("td,edn->ten", case.x, case.w_gate_up)  # [T, E, 2 * inter]
    h = act(gate_up[..., :inter]) * gate_up[..., inter:]
    per_expert = torch.einsum("tei,eid->ted", h, case.w_down)  # [T, E, dim]
    dense = torch.zeros(11, 6).scatter_add_(1, case.topk_ids, case.topk_weights)
    expected = torch.einsum("te,ted->td", dense, per_expert)
    torch.testing.assert_close(fused_moe_ref(*case.args(), activation), expected, atol=1e-5, rtol=1e-5)


def test_reference_rejects_bad_expert_ids() -> None:
    case = make_moe_case(3, 16, 16, 4, 2, torch.float32, "cpu")
    case.topk_ids[1, 1] = 4
    with pytest.raises(ValueError, match="expert 4 is not in 0..3"):
        fused_moe_ref(*case.args())


# --- argument checks ---

def valid_args() -> dict[str, object]:
    case = make_moe_case(5, 32, 16, 4, 2, torch.float32, "cpu")
    return {"x": case.x, "w_gate_up": case.w_gate_up, "w_down": case.w_down,
            "topk_weights": case.topk_weights, "topk_ids": case.topk_ids}


def set_id(value: int):
    def mutate(args: dict) -> None:
        args["topk_ids"] = args["topk_ids"].clone()
        args["topk_ids"][2, 1] = value
    return mutate


def all_double(args: dict) -> None:
    for name in ("x", "w_gate_up", "w_down"):
        args[name] = args[name].double()


BAD_ARGUMENTS = [
    (lambda a: a.update(x=a["x"][0]), "x must be 2-D"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"][0]), "w_gate_up must be 3-D"),
    (lambda a: a.update(w_down=a["w_down"][0]), "w_down must be 3-D"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:, 0]), "topk_ids must be 2-D"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"][:, :16].contiguous()), r"w_gate_up.shape\[1\] must equal"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"][..., :31].contiguous()), r"w_gate_up.shape\[2\] must equal"),
    (lambda a: a.update(w_down=a["w_down"][:3]), r"w_gate_up.shape\[0\] must equal"),
    (lambda a: a.update(w_down=a["w_down"][..., :8].contiguous()), r"w_down.shape\[2\] must equal"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:4], topk_weights=a["topk_weights"][:4]),
     r"topk_ids.shape\[0\] must equal"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), "topk_weights shape"),
    (all_double, "x must have dtype"),
    (lambda a: a.update(w_down=a["w_down"].half()), "must have the same dtype"),
    (lambda a: a.update(topk_weights=a["topk_weights"].bfloat16()), "topk_weights must have dtype"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids must have dtype"),
    (set_id(4), r"topk_ids must be expert ids in 0..3, got values in 0..4"),
    (set_id(-1), r"topk_ids must be expert ids in 0..3"),
    (lambda a: a.update(activation="relu"), "activation must be one of"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must have a contiguous last dimension"),
    (lambda a: a.update(w_down=a["w_down"].transpose(1, 2).contiguous().transpose(1, 2)),
     "w_down must have a contiguous last dimension"),
    (lambda a: a.update(w_down=a["w_down"][:, :0], w_gate_up=a["w_gate_up"][..., :0]), "at least one expert"),
]


@pytest.mark.parametrize("op", [fused_moe, fused_moe_torch])
@pytest.mark.parametrize("mutate,message", BAD_ARGUMENTS)
def test_rejects_bad_arguments(op, mutate, message: str) -> None:
    args = valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        op(**args)


@pytest.mark.parametrize("block_m", [8, 24])
def test_forced_block_m_must_be_a_power_of_two_of_at_least_16(block_m: int) -> None:
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        fused_moe(**valid_args(), block_m=block_m)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        fused_moe(**valid_args())


# --- compiled for real GPUs ---

@needs_triton
def test_kernel_compiles_for_sm90_and_sm80_without_spills() -> None:
    """The interpreter accepts code the compiler rejects: build the cubins of both
    passes for the tiles the launcher picks (decode and prefill, bf16 and fp32)."""
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import torch
        from kernels.compile_check import TRITON_DTYPES, compile_kernel, resource_usage
        from kernels.fused_moe import choose_tiles, gemm_constants
        from kernels.fused_moe_kernel import fused_moe_gemm_kernel

        for arch in (90, 80):
            for dtype, num_pairs in ((torch.bfloat16, 32), (torch.bfloat16, 8192), (torch.float32, 8192)):
                tiles = choose_tiles(num_pairs, 8, dtype)
                t = TRITON_DTYPES[dtype]
                for out_t, n, k, per_row, act, routed in ((t, 1408, 2048, 2, "silu", False),
                                                          ("fp32", 2048, 1408, 1, "none", True)):
                    types = {"c_ptr": "*" + out_t, "a_ptr": "*" + t, "w_ptr": "*" + t, "topk_weights_ptr": "*fp32",
                             "sorted_pair_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32",
                             "stride_a_row": "i32", "stride_w_expert": "i32", "stride_w_k": "i32"}
                    constants = gemm_constants(dtype, n, k, per_row, act, routed, tiles, False)
                    compiled = compile_kernel(fused_moe_gemm_kernel, arch, types, constants, tiles.num_warps)
                    print(arch, dtype, tiles.block_m, act, resource_usage(compiled.asm["cubin"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = result.stdout.splitlines()
    assert len(rows) == 12, result.stdout
    assert all("'stack': 0" in row for row in rows if "stack" in row), result.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,dim,inter,num_experts,top_k", [
    (1, 4096, 14336, 8, 2),  # Mixtral-8x7B shapes: decode
    (300, 4096, 14336, 8, 2),  # and a prefill chunk
    (5, 2048, 768, 128, 8),  # Qwen3-30B-A3B shapes: decode, most experts idle
    (512, 2048, 768, 128, 8),
])
def test_realistic_sizes_on_gpu(num_tokens: int, dim: int, inter: int, num_experts: int, top_k: int,
                                dtype: torch.dtype) -> None:
    case = make_moe_case(num_tokens, dim, inter, num_experts, top_k, dtype, "cuda", seed=7, skew=True)
    for activation in ACTIVATIONS:
        check_against_reference(fused_moe, case, activation, GPU_TOLERANCES)


@pytest.mark.cuda
def test_large_prefill_on_gpu_matches_torch_path() -> None:
    """Many rows per expert (64-row tiles), against the torch path; the reference's
    token loop would take minutes here."""
    case = make_moe_case(4096, 2048, 768, 64, 8, torch.bfloat16, "cuda", seed=8)
    out = fused_moe(*case.args())
    expected = fused_moe_torch(*case.args())
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[torch.bfloat16])
