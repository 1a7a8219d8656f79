"""Tensor parallelism on CPU (gloo): a model split across 2 ranks gives the greedy
tokens of the whole model (transformers'), through chunked prefill, prefix hits, a swap
out and in, and a preemption; each rank holds half the heads of every KV block."""
from __future__ import annotations

import pytest

from engine import EngineConfig, EngineError, LLMEngine, SamplingParams
from tests.models.tiny import SPECS, hf_greedy, random_prompts

MAX_TOKENS = 10


def tp_engine(folder, **kw) -> LLMEngine:
    cfg = dict(model=str(folder), device="cpu", dtype="float32", attention_backend="torch",
               block_size=4, num_gpu_blocks=96, num_cpu_blocks=96, tensor_parallel_size=2,
               max_num_batched_tokens=24)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.mark.parametrize("name", ["gqa16", "qwen3", "mixtral", "gemma2"])
def test_two_ranks_give_the_whole_models_tokens(tiny_model, name):
    folder = tiny_model(name)
    vocab = SPECS[name].vocab_size
    prefix = random_prompts(vocab, [13], seed=8)[0]
    prompts = random_prompts(vocab, [30, 7, 19], seed=3) + random_prompts(vocab, [4, 9], seed=9,
                                                                          prefix=prefix)
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    engine = tp_engine(folder)
    try:
        runner = engine.runner
        assert runner.tensor_parallel_size == 2
        memory = engine.describe_config()["rank_memory"]
        assert [m["rank"] for m in memory] == [0, 1]
        assert memory[0]["kv_bytes"] == memory[1]["kv_bytes"] == runner.kv_cache.numel() * 4
        assert runner.kv_cache.shape[4] == SPECS[name].num_kv_heads // 2  # half the KV heads
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts[:4]):
            engine.add_request(f"r{i}", p, params)
        final = {}
        for step in range(500):
            if step == 3:
                engine.swap_out("r0")
            if step == 5:
                engine.swap_in("r0")
                engine.preempt("r1")
            if step == 6:  # shares the prefix of r3, whose blocks are cached by now
                engine.add_request("r4", prompts[4], params)
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
            engine.kv.check_invariants()
            if not engine.has_unfinished_requests():
                break
        assert [final[f"r{i}"].output_token_ids for i in range(5)] == expected
        assert final["r4"].num_cached_tokens >= 12
        assert engine.metrics()["num_swaps_in"] == 1 and final["r1"].num_preemptions == 1
    finally:
        engine.close()


def test_a_split_that_does_not_divide_the_heads_is_refused(tiny_model):
    with pytest.raises(EngineError, match="tensor_parallel_size=2 must divide the model's "
                                          "num_attention_heads \\(3\\)"):
        tp_engine(tiny_model("qwen2"))


def test_an_fp8_cache_split_over_two_ranks(tiny_model):
    """Each rank quantises its heads with its own scales (per KV head: the same as the
    whole model's), so two ranks give the one-rank fp8 engine's tokens and logprobs."""
    from tests.engine.test_fp8_kv import mean_abs_diff, scored
    from tests.engine.test_model_parity import make_engine

    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [30, 9], seed=3)
    whole = make_engine(folder, kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")
    tokens, logprobs = scored(whole, prompts)
    engine = tp_engine(folder, kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")
    try:
        assert engine.runner.kv_cache.dtype == whole.runner.kv_cache.dtype
        assert engine.runner.kv_cache.shape[4] == SPECS["gqa16"].num_kv_heads // 2
        split_tokens, split_logprobs = scored(engine, prompts)
        assert split_tokens == tokens
        assert mean_abs_diff(split_logprobs, logprobs) < 1e-3
    finally:
        engine.close()
