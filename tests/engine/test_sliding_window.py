"""Sliding windows give blocks back: when every layer attends only to the last
`window` tokens, a request holds the blocks its window reaches (plus the one being
filled), however long it runs; the freed blocks stay in the prefix cache; swap,
preemption and forks keep working; and a real windowed model still gives
transformers' tokens."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.models.tiny import SPECS, hf_greedy, random_prompts

from .sim import expected, greedy, run_all, sim_engine

WINDOW, BS = 10, 4
MOST_BLOCKS = -(-WINDOW // BS) + 2  # blocks a window of 10 can straddle, and the one filling


def held(engine, rid: str) -> int:
    return len(engine.kv.req_to_blocks.get(rid, ()))


def test_a_long_generation_holds_a_bounded_number_of_blocks():
    engine = sim_engine(simulate_sliding_window=WINDOW, num_gpu_blocks=16,
                        max_num_batched_tokens=16)
    prompt = list(range(100, 140))  # 10 blocks: more than the pool could hold with 300 more
    engine.add_request("long", prompt, greedy(300))
    most, final = 0, {}
    for _ in range(1000):  # (without the frees it could never finish: no endless loop)
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.kv.check_invariants()
        most = max(most, held(engine, "long"))
        if not engine.has_unfinished_requests():
            break
    assert final["long"].output_token_ids == expected(prompt, 300)
    assert most <= MOST_BLOCKS + 16 // BS  # a chunk of 16 prompt tokens adds its own blocks
    assert engine.metrics()["num_preemptions"] == 0
    freed = [e for e in engine.take_events() if e.type == "WindowFreed"]
    # all but the last few of its 85 blocks went back while it ran
    assert sum(len(e.block_ids) for e in freed) >= 340 // BS - MOST_BLOCKS - 16 // BS
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_decode_holds_only_the_window_and_the_snapshot_says_what_was_given_back():
    engine = sim_engine(simulate_sliding_window=WINDOW)
    engine.add_request("r", list(range(1, 6)), greedy(60))
    for _ in range(40):
        engine.step()
        assert held(engine, "r") <= MOST_BLOCKS
    request = engine.scheduler.requests["r"]
    freed = engine.kv.window_freed("r")
    assert freed > 0 and freed + held(engine, "r") == -(-request.num_computed_tokens // BS)
    (entry,) = [r for r in engine.snapshot()["requests"] if r["request_id"] == "r"]
    assert entry["window_freed_blocks"] == freed and len(entry["block_table"]) == held(engine, "r")
    assert engine.describe_config()["sliding_window"] == WINDOW
    # the runner's table keeps positions: -1 where blocks were given back
    ids = engine.kv.step_block_ids("r")
    assert ids[:freed] == [-1] * freed and -1 not in ids[freed:]
    final = run_all(engine)
    assert final["r"].output_token_ids == expected(list(range(1, 6)), 60)


def test_freed_blocks_stay_in_the_prefix_cache():
    engine = sim_engine(simulate_sliding_window=WINDOW)
    prompt = list(range(200, 236))  # 9 full blocks
    engine.generate([prompt], greedy(20))
    (again,) = engine.generate([prompt + [7]], greedy(5))
    assert again.num_cached_tokens == 36
    assert again.output_token_ids == expected(prompt + [7], 5)


@pytest.mark.parametrize("action", ["swap", "preempt"])
def test_swap_and_preemption_of_a_request_that_gave_blocks_back(action):
    engine = sim_engine(simulate_sliding_window=WINDOW)
    ps = [list(range(10, 40)), list(range(50, 61))]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(40))
    for _ in range(12):
        engine.step()
    assert engine.kv.window_freed("r0") > 0
    if action == "swap":
        engine.swap_out("r0")
        engine.step()
        engine.kv.check_invariants()
        engine.swap_in("r0")
    else:
        engine.preempt("r0")
    final = run_all(engine)
    assert [final[f"r{i}"].output_token_ids for i in range(2)] == [expected(p, 40) for p in ps]
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_forked_samples_give_back_their_shared_blocks():
    engine = sim_engine(simulate_sliding_window=WINDOW)
    prompt = list(range(300, 330))
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, n=3))
    assert [s.output_token_ids for s in out.samples] == [expected(prompt, 30)] * 3
    engine.kv.check_invariants()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_a_real_windowed_model_matches_transformers_and_stays_bounded(tiny_model):
    """Mistral with an 8-token window on every layer, blocks of 4: 70 tokens on a
    40-token prompt, never more than 4 blocks once decoding, transformers' tokens."""
    from tests.engine.test_model_parity import make_engine

    folder = tiny_model("mistral-window")
    (prompt,) = random_prompts(SPECS["mistral-window"].vocab_size, [40], seed=11)
    engine = make_engine(folder, num_gpu_blocks=24, max_num_batched_tokens=16)
    assert engine.runner.sliding_window == 8
    engine.add_request("r", prompt, SamplingParams(max_tokens=70, temperature=0.0,
                                                   ignore_eos=True))
    most, final = 0, {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.kv.check_invariants()
        if engine.scheduler.requests.get("r") is not None and \
                engine.scheduler.requests["r"].num_output_tokens > 0:
            most = max(most, held(engine, "r"))
    assert final["r"].output_token_ids == hf_greedy(folder, [prompt], 70)[0]
    assert 0 < most <= -(-8 // 4) + 2
