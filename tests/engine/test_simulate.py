import dataclasses

import pytest

from engine.sim.capacity import replay_contiguous, replay_paged, slot_usage
from engine.config import EngineConfig
from engine.sim.simulate import main
from engine.sim.trace import TraceRequest, load_trace, prompt_tokens, synthetic_trace


def test_paged_beats_contiguous_reservation_on_utilisation_and_concurrency():
    # Everyone arrives at once, so the pool's capacity decides the concurrency.
    trace = synthetic_trace(60, seed=3, rate_per_s=1000.0, prompt_range=(16, 300),
                            output_range=(8, 100), prefix_len=64)
    cfg = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                       vocab_size=32000, block_size=16, num_gpu_blocks=512,
                       num_cpu_blocks=0, max_model_len=512, max_pending_events=0)
    paged = replay_paged(trace, cfg)
    contiguous = replay_contiguous(trace, 512 * 16, 512, 256, 2048)
    assert paged.utilisation > 0.9 > contiguous.utilisation
    assert paged.peak_concurrency > contiguous.peak_concurrency
    assert paged.sim_seconds < contiguous.sim_seconds
    assert paged.prefix_hit_rate > 0


def test_shared_prefix_groups_share_tokens():
    a = TraceRequest(0.0, 40, 5, prefix_group=1, prefix_len=32)
    b = TraceRequest(0.1, 50, 5, prefix_group=1, prefix_len=32)
    ta, tb = prompt_tokens(a, 0, 1000), prompt_tokens(b, 1, 1000)
    assert ta[:32] == tb[:32] and ta[32:] != tb[32:40]
    assert len(ta) == 40 and len(tb) == 50


def test_trace_files_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_len,output_len,prefix_group,prefix_len\n"
                        "0.5,20,4,,0\n0.1,40,3,2,32\n")
    rows = load_trace(csv_path)
    assert [r.arrival_s for r in rows] == [0.1, 0.5]
    assert rows[0].prefix_group == 2 and rows[1].prefix_group is None
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 2}\n')
    assert load_trace(jl)[0].prompt_len == 3
    with pytest.raises(ValueError):
        TraceRequest(0.0, 10, 2, prefix_group=1, prefix_len=11)


def test_cli_prints_both_allocators(capsys, tmp_path):
    assert main(["--synthetic", "30", "--num-gpu-blocks", "256", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "paged" in out and "contiguous" in out and "KV util" in out
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_len,output_len\n0,300,3\n")
    assert main(["--trace", str(bad), "--max-model-len", "256"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_a_sliding_window_is_modelled():
    """With a window on every layer, requests give back the blocks out of reach: more of
    them run at once than when each keeps its whole context, and the contiguous
    allocator reserves a ring buffer of the window instead of max_model_len."""
    trace = synthetic_trace(60, seed=3, rate_per_s=1000.0, prompt_range=(16, 300),
                            output_range=(100, 400), prefix_len=64)
    cfg = dict(simulate=True, simulate_tokenizer="bytes",
               vocab_size=32000, block_size=16, num_gpu_blocks=256,
               num_cpu_blocks=0, max_model_len=1024, max_pending_events=0)
    full = replay_paged(trace, EngineConfig(**cfg))
    windowed = replay_paged(trace, EngineConfig(**cfg, simulate_sliding_window=64))
    assert windowed.mean_concurrency > 1.5 * full.mean_concurrency
    assert windowed.sim_seconds < full.sim_seconds
    ring = replay_contiguous(trace, 256 * 16, 1024, 256, 2048, window=64)
    whole = replay_contiguous(trace, 256 * 16, 1024, 256, 2048)
    assert ring.peak_concurrency > whole.peak_concurrency


def test_layer_groups_are_modelled(capsys):
    """A model with global and sliding layers (--hybrid): with a table per layer group
    the sliding layers give back what the window passed, so in the same memory (one
    table: half as many blocks, each holding both groups' layers) more requests run at
    once and the trace ends sooner."""
    trace = synthetic_trace(60, seed=3, rate_per_s=1000.0, prompt_range=(16, 300),
                            output_range=(100, 400), prefix_len=64)
    cfg = dict(simulate=True, simulate_tokenizer="bytes",
               vocab_size=32000, block_size=16, num_cpu_blocks=0,
               max_model_len=1024, max_pending_events=0)
    groups = replay_paged(trace, EngineConfig(**cfg, num_gpu_blocks=256,
                                              simulate_sliding_window=64, simulate_hybrid=True))
    one = replay_paged(trace, EngineConfig(**cfg, num_gpu_blocks=128))
    assert groups.mean_concurrency > 1.2 * one.mean_concurrency
    assert groups.sim_seconds < one.sim_seconds
    # and it is neither a pool of one table nor of sliding layers only: a token in the
    # window takes a block's slot in each group
    for other in (EngineConfig(**cfg, num_gpu_blocks=256),
                  EngineConfig(**cfg, num_gpu_blocks=256, simulate_sliding_window=64)):
        assert groups.mean_concurrency < replay_paged(trace, other).mean_concurrency
    assert main(["--synthetic", "30", "--num-gpu-blocks", "256", "--max-model-len", "256",
                 "--sliding-window", "32", "--hybrid"]) == 0
    out = capsys.readouterr().out
    assert "a table per layer group" in out and "one table" in out
    assert main(["--synthetic", "30", "--hybrid"]) == 2
    assert "--hybrid needs --sliding-window" in capsys.readouterr().err


def test_a_cpu_tier_raises_the_hit_rate_of_a_trace_whose_prefixes_overflow_the_pool(capsys):
    # 40 shared prefixes of 8 blocks cannot all stay in a 96-block pool: with the tier,
    # those pushed out come back from CPU memory instead of being recomputed.
    args = ["--synthetic", "150", "--prefix-groups", "40", "--prefix-len", "128",
            "--num-gpu-blocks", "96", "--max-model-len", "512"]
    trace = synthetic_trace(150, seed=0, rate_per_s=20.0, prompt_range=(16, 256),
                            output_range=(16, 128), num_prefix_groups=40, prefix_len=128)
    base = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                        vocab_size=32000, block_size=16, num_gpu_blocks=96,
                        num_cpu_blocks=1024, max_model_len=512, max_pending_events=0)
    without = replay_paged(trace, base)
    with_tier = replay_paged(trace, dataclasses.replace(base, cpu_prefix_cache=True))
    assert with_tier.prefix_hit_rate > without.prefix_hit_rate
    assert with_tier.extra["cpu_hit_rate"] > 0 == without.extra["cpu_hit_rate"]
    assert main(args + ["--cpu-cache-blocks", "1024"]) == 0
    out = capsys.readouterr().out
    assert "paged + CPU tier" in out
    assert (f"{100 * without.prefix_hit_rate:.1f}% without the CPU tier, "
            f"{100 * with_tier.prefix_hit_rate:.1f}% with 1024 CPU blocks") in out


def test_layer_groups_are_modelled_only_where_a_model_keeps_them():
    cfg = dict(simulate=True, simulate_tokenizer="bytes",
               simulate_sliding_window=64, simulate_hybrid=True)
    for off in (dict(cpu_prefix_cache=True), dict(hybrid_kv_cache=False)):
        with pytest.raises(ValueError, match="simulate_hybrid"):
            EngineConfig(**cfg, **off)
    assert main(["--synthetic", "10", "--sliding-window", "32", "--hybrid",
                 "--cpu-cache-blocks", "64"]) == 2


def _slot_usage_block_by_block(engine) -> tuple[int, int]:
    """slot_usage's reference: each held block's tokens, the fullest holder's."""
    bs, fill = engine.config.block_size, {}
    for manager in engine.kv.groups:
        for rid, table in manager.req_to_blocks.items():
            computed = engine.scheduler.requests[rid].num_computed_tokens
            for i, block in enumerate(table, start=manager.window_freed(rid)):
                fill[block.block_id] = max(fill.get(block.block_id, 0),
                                           min(bs, max(computed - i * bs, 0)))
    return sum(fill.values()), len(fill) * bs


@pytest.mark.parametrize("changes", [
    {},  # shared prefixes, a pool that preempts
    {"preemption_mode": "swap", "num_cpu_blocks": 256},
    {"simulate_sliding_window": 40},  # blocks out of the window given back
    {"simulate_sliding_window": 40, "simulate_hybrid": True},  # a table per layer group
])
def test_slot_usage_counts_each_held_block_once_as_full_as_its_fullest_holder(changes):
    trace = synthetic_trace(40, seed=5, rate_per_s=200.0, prompt_range=(20, 200),
                            output_range=(4, 60), num_prefix_groups=2, prefix_len=37)
    cfg = dataclasses.replace(EngineConfig(
        simulate=True, simulate_tokenizer="bytes", vocab_size=32000, block_size=8,
        num_gpu_blocks=96, num_cpu_blocks=0, max_model_len=512, max_num_seqs=12,
        max_pending_events=0), **changes)
    seen = []

    class Check:
        def before_step(self, engine, now):
            pass

        def after_step(self, engine, now):
            seen.append((slot_usage(engine), _slot_usage_block_by_block(engine)))

    result = replay_paged(trace, cfg, observer=Check())
    assert seen and all(fast == reference for fast, reference in seen)
    assert any(used < allocated for (used, allocated), _ in seen)  # partly filled blocks
    if not changes:
        assert result.preemptions > 0 and result.prefix_hit_rate > 0
