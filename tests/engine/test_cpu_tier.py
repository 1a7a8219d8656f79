"""The CPU pool as a second-level prefix cache (EngineConfig.cpu_prefix_cache), on the
simulated model, whose tokens depend on every KV slot it reads: a copy to or from the
CPU tier that moved the wrong data changes the output."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.sched import scheduler
from engine.block_hash import hash_blocks, root_hash
from engine.config import ConfigError

from tests.engine.test_model_parity import make_engine
from tests.models.tiny import SPECS, hf_greedy, random_prompts

from .sim import expected, greedy, run_all, sim_engine

BLOCK = 4


def _prompt(seed: int, n: int = 32) -> list[int]:
    return [(seed * 131 + i * 7) % 997 + 1 for i in range(n)]


def _tier_engine(**kw):
    cfg = dict(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=64, cpu_prefix_cache=True,
               max_num_batched_tokens=64)
    cfg.update(kw)
    return sim_engine(**cfg)


def _run(engine, rid, prompt, max_tokens=6):
    engine.add_request(rid, prompt, greedy(max_tokens))
    return run_all(engine)[rid]


def _push_out_of_the_gpu(engine, first: list[int]) -> None:
    """Run other prompts until none of `first`'s blocks is cached on the GPU."""
    for seed in range(1, 6):
        _run(engine, f"other{seed}", _prompt(seed))
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    assert not engine.kv.cached_chain(hashes), "the first prompt is still on the GPU"


@pytest.fixture(params=["ahead", "at-reuse"])
def copy_when(request, monkeypatch):
    """Copies to the tier ahead of need (the default), or only when a block is reused."""
    if request.param == "at-reuse":
        monkeypatch.setattr(scheduler, "COPY_AHEAD_BLOCKS", 0)
    return request.param


def test_a_prefix_pushed_off_the_gpu_comes_back_from_the_cpu_tier(copy_when):
    engine = _tier_engine()
    first = _prompt(0)
    cold = _run(engine, "cold", first)
    _push_out_of_the_gpu(engine, first)
    assert engine.metrics()["num_cpu_cached_blocks"] > 0
    again = _run(engine, "again", first)
    # 8 full blocks; the last token is always computed, so its block is recomputed
    assert again.num_cached_tokens == 28
    assert again.output_token_ids == cold.output_token_ids == expected(first, 6)
    m = engine.metrics()
    assert m["cpu_prefix_cache_hits"] == 28
    assert m["cpu_cache_copy_in_bytes"] == 7 * engine.runner.block_bytes
    assert m["cpu_cache_copy_out_bytes"] >= 7 * engine.runner.block_bytes
    engine.kv.check_invariants()


def test_without_the_tier_the_same_prefix_is_recomputed():
    engine = _tier_engine(cpu_prefix_cache=False)
    first = _prompt(0)
    _run(engine, "cold", first)
    _push_out_of_the_gpu(engine, first)
    again = _run(engine, "again", first)
    assert again.num_cached_tokens == 0
    assert engine.metrics()["cpu_prefix_cache_hits"] == 0
    assert engine.metrics()["num_cpu_cached_blocks"] == 0


def test_cached_blocks_next_in_line_are_copied_ahead_once():
    engine = _tier_engine()
    first = _prompt(0)
    _run(engine, "cold", first)
    engine.add_request("next", _prompt(1), greedy(2))
    engine.step()  # its forward pass runs beside the copies of the free cached blocks
    free_cached = {b.block_hash for b in engine.kv.gpu.free_queue if b.block_hash is not None}
    assert free_cached and free_cached <= set(engine.kv.cpu.cached)
    copied = engine.metrics()["cpu_cache_copy_out_bytes"]
    assert copied == len(engine.kv.cpu.cached) * engine.runner.block_bytes
    run_all(engine)
    _push_out_of_the_gpu(engine, first)
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    assert set(hashes[:7]) <= set(engine.kv.cpu.cached)
    assert engine.kv.tiers[0].num_blocks_stored < 2 * len(engine.kv.cpu.cached)  # each once
    assert _run(engine, "again", first).output_token_ids == expected(first, 6)


def test_a_longer_prompt_continues_from_the_gpu_into_the_cpu_tier(copy_when):
    # The prompt's head stays on the GPU (a running request holds it), its tail only on
    # the CPU tier: one hit reads both, and the output is still right.
    engine = _tier_engine(num_gpu_blocks=24)
    first = _prompt(0)
    _run(engine, "cold", first)
    _push_out_of_the_gpu(engine, first)
    longer = first + [5, 6, 7]
    out = _run(engine, "longer", longer)
    assert out.num_cached_tokens == 32
    assert out.output_token_ids == expected(longer, 6)


def test_swapped_requests_take_cpu_blocks_from_the_cached_ones(copy_when):
    engine = _tier_engine(num_cpu_blocks=12, preemption_mode="swap")
    first = _prompt(0)
    _run(engine, "cold", first)
    _push_out_of_the_gpu(engine, first)
    assert len(engine.kv.cpu.cached) == 12  # the tier fills the whole CPU pool
    prompt = _prompt(9, 20)
    engine.add_request("parked", prompt, greedy(8))
    for _ in range(3):
        engine.step()
    result = engine.swap_out("parked")  # 6 blocks: taken from the tier's cached ones
    assert result["num_blocks"] == 6
    assert len(engine.kv.cpu.cached) <= 6
    engine.swap_in("parked")
    final = run_all(engine)
    assert final["parked"].output_token_ids == expected(prompt, 8)
    engine.kv.check_invariants()


def test_a_reset_forgets_the_cpu_tier_too():
    engine = _tier_engine()
    first = _prompt(0)
    _run(engine, "cold", first)
    _push_out_of_the_gpu(engine, first)
    result = engine.reset_prefix_cache()
    assert result["num_cpu_blocks_forgotten"] > 0
    assert not engine.kv.cpu.cached
    assert _run(engine, "again", first).num_cached_tokens == 0


def test_the_tier_needs_cpu_blocks_and_prefix_caching():
    with pytest.raises(ConfigError, match="num_cpu_blocks"):
        EngineConfig(simulate=True, simulate_tokenizer="bytes",
                     num_cpu_blocks=0, cpu_prefix_cache=True)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(simulate=True, simulate_tokenizer="bytes",
                     enable_prefix_caching=False, cpu_prefix_cache=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_copies_ahead_run_beside_the_forward_pass(tiny_model):
    """The real model on CUDA: the tier's copies ahead of need run on a stream of their
    own while the steps run; prefixes read back from the CPU equal transformers'."""
    folder = tiny_model("gqa16")
    vocab = SPECS["gqa16"].vocab_size
    prefix = random_prompts(vocab, [13], seed=8)[0]
    first, last = random_prompts(vocab, [5, 9], seed=9, prefix=prefix)
    prompts = [first, *random_prompts(vocab, [30, 31, 29], seed=11), last]
    engine = make_engine(folder, device="cuda", num_gpu_blocks=16, num_cpu_blocks=64,
                         cpu_prefix_cache=True)
    done = [engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0,
                                                ignore_eos=True))[0] for p in prompts]
    assert engine.runner.block_io.copy_stream is not None  # (copies ahead did run on it)
    assert done[-1].num_cached_tokens >= 12
    assert [o.output_token_ids for o in done] == hf_greedy(folder, prompts, 12)
