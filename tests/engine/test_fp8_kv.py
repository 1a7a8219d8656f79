"""FP8 K/V caches in the engine (EngineConfig.kv_cache_dtype), on tiny random models:

* the prompt's log-probabilities stay within a stated bound of the model's own dtype
  (and are not equal to them: the cache really is fp8);
* the Triton kernels (the interpreter here) and the torch path agree on an fp8 cache;
* the pool holds a quarter of float32's bytes per block, so four times the blocks;
* blocks move as bytes: swap, copy, read/write for moves, the CPU pool's bytes for
  the disk tier;
* scales are calibrated alike at every start, per layer or per head, and their
  digest is part of the K/V format that moves and the disk tier check.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from benchmarks.kv_quality import transformers_prompt_logprobs  # noqa: E402
from tests.engine.test_model_parity import make_engine  # noqa: E402
from tests.models.tiny import SPECS, random_prompts  # noqa: E402

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def scored(engine, prompts, max_tokens=4):
    """(greedy tokens, each prompt's log-probabilities after its first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    return ([o.output_token_ids for o in outs],
            [[entry[1] for entry in o.prompt_logprobs[1:]] for o in outs])


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_matches_transformers_with_fp8_kv(tiny_model, kv_cache_dtype):
    """The engine's fp8 run equals transformers whose K and V go through fp8 at the
    same scales, and differs from the unquantised model (more with e5m2's 2 mantissa
    bits than e4m3's 3)."""
    folder = tiny_model("gqa64")
    prompts = random_prompts(SPECS["gqa64"].vocab_size, [23, 9, 40], seed=3)
    fp8 = make_engine(folder, kv_cache_dtype=kv_cache_dtype)
    _, got = scored(fp8, prompts)
    want = transformers_prompt_logprobs(folder, prompts, FP8[kv_cache_dtype], fp8.runner.kv_scales)
    # equal but where a K or V value sat at an fp8 rounding boundary, which float32
    # noise between the two implementations tips one way or the other (and every later
    # position that attends to it moves a little)
    assert mean_abs_diff(want, got) < 0.01
    base = make_engine(folder)
    _, exact = scored(base, prompts)
    assert mean_abs_diff(exact, got) > 10 * mean_abs_diff(want, got)
    # a quarter of float32's bytes: the same memory holds four times the blocks
    assert fp8.runner.block_bytes * 4 == base.runner.block_bytes
    assert fp8.runner.kv_cache.dtype == FP8[kv_cache_dtype]
    described = fp8.describe_config()
    assert described["kv_cache_dtype"] == kv_cache_dtype
    assert described["kv_bytes_per_block"] == fp8.runner.block_bytes
    assert described["kv_format"].startswith(str(FP8[kv_cache_dtype]).removeprefix("torch."))
    assert base.describe_config()["kv_format"] == "float32"


def test_e5m2_errs_more_than_e4m3(tiny_model):
    folder = tiny_model("gqa64")
    prompts = random_prompts(SPECS["gqa64"].vocab_size, [23, 40], seed=4)
    _, exact = scored(make_engine(folder), prompts)
    diffs = {name: mean_abs_diff(exact, scored(make_engine(folder, kv_cache_dtype=name), prompts)[1])
             for name in FP8}
    assert 0 < diffs["fp8_e4m3"] < diffs["fp8_e5m2"], diffs


def test_pool_sized_from_memory_holds_more_fp8_blocks(tiny_model):
    folder = tiny_model("gqa16")
    budget = 1 << 20
    base = make_engine(folder, num_gpu_blocks=None, kv_cache_memory_bytes=budget)
    fp8 = make_engine(folder, num_gpu_blocks=None, kv_cache_memory_bytes=budget,
                      kv_cache_dtype="fp8_e4m3")
    assert fp8.kv.gpu.num_blocks == budget // fp8.runner.block_bytes
    assert fp8.kv.gpu.num_blocks == 4 * base.kv.gpu.num_blocks


def test_triton_kernels_and_the_torch_path_agree_on_fp8(tiny_model):
    pytest.importorskip("triton")
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [11, 6], seed=5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_path = make_engine(folder, kv_cache_dtype="fp8_e4m3", device=device)
    triton = make_engine(folder, kv_cache_dtype="fp8_e4m3", attention_backend="triton",
                         device=device, max_num_batched_tokens=16)
    assert triton.runner.attention.name == "triton"
    assert torch.equal(triton.runner.kv_scales, torch_path.runner.kv_scales)
    tokens_a, lp_a = scored(torch_path, prompts)
    tokens_b, lp_b = scored(triton, prompts)
    assert tokens_a == tokens_b
    assert mean_abs_diff(lp_a, lp_b) < 1e-4


def test_scales_per_layer_per_head_or_unit(tiny_model):
    folder = tiny_model("gqa64")
    tensor = make_engine(folder, kv_cache_dtype="fp8_e4m3")
    again = make_engine(folder, kv_cache_dtype="fp8_e4m3")
    head = make_engine(folder, kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")
    unit = make_engine(folder, kv_cache_dtype="fp8_e4m3", kv_cache_scales="unit")
    n_layers, n_kv = SPECS["gqa64"].num_layers, SPECS["gqa64"].num_kv_heads
    s = tensor.runner.kv_scales
    assert s.shape == (n_layers, 2, n_kv)
    assert torch.equal(s, s[..., :1].expand_as(s))  # one scale per layer's K, one per V
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    assert torch.equal(again.runner.kv_scales, s)  # the same at every start
    assert again.runner.kv_format == tensor.runner.kv_format
    assert torch.equal(head.runner.kv_scales.amax(-1), s.amax(-1))  # per head, same widest
    assert head.runner.kv_format != tensor.runner.kv_format
    assert torch.equal(unit.runner.kv_scales, torch.ones_like(s))
    assert unit.describe_config()["kv_cache_scales"] == "unit"


def test_fp8_blocks_move_as_bytes(tiny_model):
    """Swaps, copies, a move's read/write and the disk tier's CPU block bytes carry
    the stored bytes unchanged (NaN codes included)."""
    engine = make_engine(tiny_model("gqa16"), kv_cache_dtype="fp8_e5m2", num_gpu_blocks=8,
                         num_cpu_blocks=8)
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, runner.kv_cache.shape, generator=gen, dtype=torch.uint8)
    runner.kv_cache.view(torch.uint8).copy_(noise)
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    runner.swap_out([(1, 2), (5, 0)])
    assert torch.equal(bits(runner.cpu_cache[:, :, 2]), noise[:, :, 1])
    assert torch.equal(bits(runner.cpu_cache[:, :, 0]), noise[:, :, 5])
    runner.swap_in([(2, 7)])
    assert torch.equal(bits(runner.kv_cache[:, :, 7]), noise[:, :, 1])
    runner.copy_blocks([(3, 4)])
    assert torch.equal(bits(runner.kv_cache[:, :, 4]), noise[:, :, 3])
    read = runner.read_blocks([0, 6])
    runner.write_blocks([1, 2], read)
    assert torch.equal(bits(runner.kv_cache[:, :, 1:3]), noise[:, :, [0, 6]])
    header, frames = runner.blocks_to_frames(read)
    assert torch.equal(bits(runner.blocks_from_frames(header, frames, 2)), bits(read))
    data = runner.read_pool_block("cpu", 2)
    runner.write_pool_block("cpu", 5, data)
    assert torch.equal(bits(runner.cpu_cache[:, :, 5]), noise[:, :, 1])
    runner.write_pool_block("gpu", 6, runner.read_pool_block("gpu", 3))
    assert torch.equal(bits(runner.kv_cache[:, :, 6]), noise[:, :, 3])
    with pytest.raises(ValueError, match="do not fit"):
        runner.write_blocks([3], read[:, :, :1].float())


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match="kv_cache_scales must be one of"):
        EngineConfig(kv_cache_scales="row")
    with pytest.raises(ConfigError, match="simulator"):
        EngineConfig(simulate=True, kv_cache_dtype="fp8_e4m3")
