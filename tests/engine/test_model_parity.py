"""The engine on tiny random Llama-family models: greedy output must equal transformers'
greedy output (float32), whatever happens to the requests on the way: chunked prefill,
prefix-cache hits, copy-on-write, preemption by recompute, swap out and in, operator
actions in the middle of decoding."""
from __future__ import annotations

import os

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import NotEnoughBlocksError
from engine.kv.layout import kv_layout
from engine.model.loader import read_model_folder
from engine.model.transformer import Linear
from kernels import cpu_ext
from engine.model.ops.cpu_ops import PACKED_MAX_ROWS, CpuKernelOps
from tests.models.tiny import SPECS, hf_greedy, random_prompts

MAX_TOKENS = 12
LENGTHS = [1, 5, 17, 33, 64]


def make_engine(folder, **kw) -> LLMEngine:
    # the C++ CPU kernels on whatever the CPU (auto would leave them off without AVX-512)
    cfg = dict(model=str(folder), device="cpu", dtype="float32", attention_backend="torch",
               block_size=4, num_gpu_blocks=256, num_cpu_blocks=256, seed=0, cpu_kernels="on")
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def outputs(outs) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def run_all(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.kv.check_invariants()
    return final


@pytest.mark.parametrize("name", sorted(SPECS))
def test_plain_batch_matches_transformers(tiny_model, name):
    folder = tiny_model(name)
    prompts = random_prompts(SPECS[name].vocab_size, LENGTHS, seed=1)
    engine = make_engine(folder)
    got = outputs(engine.generate(prompts, greedy()))
    assert got == hf_greedy(folder, prompts, MAX_TOKENS)
    assert any(len(set(g)) > 2 for g in got), "degenerate model: the test would prove little"
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_paths_without_the_cpu_kernels(tiny_model, name, monkeypatch):
    """cpu_kernels=False: gathered-attention decodes, cascade prefixes and torch's
    element-wise ops (the fallback where no compiler is) give the same tokens."""
    folder = tiny_model(name)
    vocab = SPECS[name].vocab_size
    prefix = random_prompts(vocab, [26], seed=7)[0]
    prompts = random_prompts(vocab, LENGTHS, seed=1) + random_prompts(vocab, [3, 9], seed=2,
                                                                     prefix=prefix)
    engine = make_engine(folder, cpu_kernels=False)
    assert engine.runner.ops.name == "torch" and not engine.runner.attention.native
    assert outputs(engine.generate(prompts, greedy())) == hf_greedy(folder, prompts, MAX_TOKENS)


def test_cpu_kernels_by_default_where_the_cpu_has_avx512(tiny_model):
    """cpu_kernels="auto" (the default) runs them on a CPU with AVX-512 and not on one
    without; "on" runs them anywhere they build."""
    if os.environ.get("KVOPS_CPU_KERNELS") == "0":
        pytest.skip("KVOPS_CPU_KERNELS=0 turns them off")
    folder = tiny_model("gqa16")
    forced = make_engine(folder)
    assert isinstance(forced.runner.ops, CpuKernelOps) and forced.runner.attention.native
    auto = make_engine(folder, cpu_kernels="auto")
    wide = "avx512f" in cpu_ext.cpu_flags()
    assert isinstance(auto.runner.ops, CpuKernelOps) == wide
    assert auto.runner.attention.native == wide
    prompts = random_prompts(SPECS["gqa16"].vocab_size, LENGTHS, seed=4)
    assert outputs(auto.generate(prompts, greedy())) == outputs(forced.generate(prompts, greedy()))


@pytest.mark.parametrize("name", ["gqa16", "mha32", "qwen2", "linear"])
@pytest.mark.parametrize("who", ["packed", "mkl"])
def test_prefill_matmuls_by_either_kernel(tiny_model, name, who, monkeypatch):
    """Which kernel does a prefill's many-row matmuls is EngineConfig.large_matmuls; each
    gives transformers' tokens (the prompts make a first step of more rows than
    decoding's)."""
    if os.environ.get("KVOPS_CPU_KERNELS") == "0":
        pytest.skip("KVOPS_CPU_KERNELS=0 turns them off")
    folder = tiny_model(name)
    prompts = random_prompts(SPECS[name].vocab_size, LENGTHS + [150], seed=3)
    engine = make_engine(folder, large_matmuls=who)
    ops = engine.runner.ops
    assert ops.max_rows == (None if who == "packed" else PACKED_MAX_ROWS)
    modules = list(engine.runner.model.modules())
    linears = [m for m in modules if isinstance(m, Linear)]
    assert {id(m) for m in linears} == ops.packed.keys()  # each has its packed copy
    assert len(ops.packed_gate_up) == SPECS[name].num_layers
    # the plain weights are kept only where MKL still reads them
    plain = [m.weight_t.numel() for m in modules if isinstance(m, Linear)]
    assert all(n == 0 for n in plain) if who == "packed" else all(n > 0 for n in plain)
    lm_head = engine.runner.model.lm_head.weight  # packed too; the embedding table if tied
    assert (lm_head.numel() > 0) == SPECS[name].tie_word_embeddings
    assert sum(LENGTHS) + 150 > PACKED_MAX_ROWS
    assert outputs(engine.generate(prompts, greedy())) == hf_greedy(folder, prompts, MAX_TOKENS)


@pytest.mark.parametrize("name", ["gqa16", "gqa64"])
def test_shared_prefix_hits_the_cache(tiny_model, name):
    folder = tiny_model(name)
    vocab = SPECS[name].vocab_size
    prefix = random_prompts(vocab, [26], seed=7)[0]  # 6 full blocks of 4, and a part
    prompts = random_prompts(vocab, [3, 9, 1, 14], seed=2, prefix=prefix)
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    engine = make_engine(folder)
    first = engine.generate(prompts[:1], greedy())
    rest = engine.generate(prompts[1:], greedy())
    assert outputs(first + rest) == expected
    assert all(o.num_cached_tokens >= 24 for o in rest)
    # All at once: later requests may hit blocks that the same step is filling.
    engine = make_engine(folder)
    assert outputs(engine.generate(prompts, greedy())) == expected


def test_whole_prompt_hit_copies_the_last_block(tiny_model):
    folder = tiny_model("gqa16")
    prompt = random_prompts(SPECS["gqa16"].vocab_size, [16], seed=3)  # exactly 4 blocks
    expected = hf_greedy(folder, prompt, MAX_TOKENS)
    engine = make_engine(folder)
    engine.generate(prompt, greedy(2))
    (out,) = engine.generate(prompt, greedy())
    assert out.num_cached_tokens == 15  # the last token is recomputed, in a copied block
    assert out.output_token_ids == expected[0]


@pytest.mark.parametrize("name", ["gqa16", "mha32"])
def test_chunked_prefill(tiny_model, name):
    folder = tiny_model(name)
    prompts = random_prompts(SPECS[name].vocab_size, LENGTHS, seed=4)
    engine = make_engine(folder, max_num_batched_tokens=7)
    assert outputs(engine.generate(prompts, greedy())) == hf_greedy(folder, prompts, MAX_TOKENS)


def test_preemption_by_recompute(tiny_model):
    folder = tiny_model("gqa64")
    prompts = random_prompts(SPECS["gqa64"].vocab_size, [20, 23, 18, 25, 21], seed=5)
    engine = make_engine(folder, num_gpu_blocks=16, enable_prefix_caching=False)
    got = outputs(engine.generate(prompts, greedy()))
    assert engine.metrics()["num_preemptions"] > 0
    assert got == hf_greedy(folder, prompts, MAX_TOKENS)


def test_preemption_by_swap(tiny_model):
    folder = tiny_model("gqa64")
    prompts = random_prompts(SPECS["gqa64"].vocab_size, [20, 23, 18, 25, 21], seed=5)
    engine = make_engine(folder, num_gpu_blocks=16, num_cpu_blocks=64,
                         preemption_mode="swap", enable_prefix_caching=False)
    got = outputs(engine.generate(prompts, greedy()))
    m = engine.metrics()
    assert m["num_swaps_out"] > 0 and m["num_swaps_in"] > 0
    assert got == hf_greedy(folder, prompts, MAX_TOKENS)


def test_operator_swap_and_preempt_mid_decode(tiny_model):
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [11, 30, 6, 40], seed=6)
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    # No prefix cache, so nothing is served from it: the swap-in must copy the blocks.
    engine = make_engine(folder, enable_prefix_caching=False)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, greedy())
    for _ in range(4):
        engine.step()
    assert all(engine.scheduler.requests[f"r{i}"].num_output_tokens >= 3 for i in range(3))
    old_blocks = set(engine.kv.block_ids("r0"))
    engine.swap_out("r0")
    engine.add_request("r3", prompts[3], greedy())  # takes the blocks r0 left, first
    engine.step()
    assert old_blocks & set(engine.kv.block_ids("r3"))
    engine.preempt("r1")
    engine.step()
    engine.swap_in("r0")
    final = run_all(engine)
    assert [final[f"r{i}"].output_token_ids for i in range(4)] == expected
    # (a swap is no preemption: r0 was swapped, r1 preempted)
    assert final["r0"].num_preemptions == 0 and final["r1"].num_preemptions == 1


# Every family in every KV situation: the engine's K/V for a request may come from the
# prefix cache, be written over several chunked steps, be dropped and recomputed, or go
# to host memory and back; the tokens must not change.
SITUATIONS = {
    "prefix-hit": dict(),
    "chunked": dict(max_num_batched_tokens=7),
    "recompute": dict(num_gpu_blocks=16, enable_prefix_caching=False),
    "swap": dict(num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode="swap",
                 enable_prefix_caching=False),
    # the prefix is pushed off the GPU by other prompts, then read back from the CPU tier
    "cpu-tier": dict(num_gpu_blocks=16, num_cpu_blocks=64, cpu_prefix_cache=True),
}


@pytest.mark.parametrize("situation", sorted(SITUATIONS))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_family_in_every_kv_situation(tiny_model, name, situation):
    folder = tiny_model(name)
    vocab = SPECS[name].vocab_size
    if situation == "prefix-hit":
        prefix = random_prompts(vocab, [13], seed=8)[0]  # 3 full blocks of 4, and a part
        prompts = random_prompts(vocab, [5, 2, 9], seed=9, prefix=prefix)
    elif situation == "cpu-tier":
        prefix = random_prompts(vocab, [13], seed=8)[0]
        first, last = random_prompts(vocab, [5, 9], seed=9, prefix=prefix)
        prompts = [first, *random_prompts(vocab, [30, 31, 29], seed=11), last]
    else:
        prompts = random_prompts(vocab, [20, 23, 18, 25, 21], seed=5)
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    engine = make_engine(folder, **same_memory(folder, SITUATIONS[situation]))
    if situation == "prefix-hit":
        first, rest = engine.generate(prompts[:1], greedy()), engine.generate(prompts[1:], greedy())
        assert all(o.num_cached_tokens >= 12 for o in rest)
        got = outputs(first + rest)
    elif situation in ("recompute", "swap"):
        got = _under_pressure(engine, prompts, situation)
    elif situation == "cpu-tier":  # one at a time: each fills most of the GPU pool
        done = [engine.generate([p], greedy())[0] for p in prompts]
        assert done[-1].num_cached_tokens >= 12
        assert engine.metrics()["cpu_prefix_cache_hits"] >= 12
        got = outputs(done)
    else:
        got = outputs(engine.generate(prompts, greedy()))
    m = engine.metrics()
    if situation == "recompute":
        assert m["num_preemptions"] > 0
    if situation == "swap":
        assert m["num_swaps_out"] > 0 and m["num_swaps_in"] > 0
    assert got == expected
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def same_memory(folder, config: dict) -> dict:
    """The config with its pool's memory kept for a model with layer groups (a block
    holds one group's layers: there are that many times more of them)."""
    if "num_gpu_blocks" not in config or config.get("cpu_prefix_cache"):
        return config
    args = read_model_folder(folder).args
    groups = kv_layout(args.layer_windows, args.n_layers).num_groups
    return {**config, "num_gpu_blocks": config["num_gpu_blocks"] * groups,
            "num_cpu_blocks": config.get("num_cpu_blocks", 256) * groups}


def _under_pressure(engine: LLMEngine, prompts: list[list[int]], situation: str) -> list[list[int]]:
    """Run the prompts in a pool too small for all of them, so the scheduler preempts
    (by recompute or swap). A model whose layers slide (all, or a layer group's) gives
    its old blocks back and may never run short: then an operator preempts, or swaps out
    and back in, the first request mid-decode."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy())
    final, parked = {}, None
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        slides = engine.runner.sliding_window or engine.runner.kv_group_windows
        if step == 8 and slides and not engine.metrics()["num_preemptions"]:
            rid = next(r.request_id for r in engine.scheduler.running)
            if situation == "swap":
                engine.swap_out(rid)
                parked = rid
            else:
                engine.preempt(rid)
        elif parked is not None:
            try:  # an operator's swap-out waits for an operator's swap-in
                engine.swap_in(parked)
                parked = None
            except NotEnoughBlocksError:
                pass
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.kv.check_invariants()
    return [final[f"r{i}"].output_token_ids for i in range(len(prompts))]
