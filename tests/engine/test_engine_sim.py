"""The engine with the simulated model: every path must give the cache-free answer."""
import json
import random

import pytest

from engine import (InvalidRequestError, InvalidStateError, NotEnoughBlocksError,
                    PrefixNotCachedError, SamplingParams, UnknownRequestError)
from engine.observe.snapshot import decode_array

from .sim import expected, greedy, run_all, sim_engine


def prompts(n, lo=1, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_plain_batch_matches_reference_and_frees_everything():
    engine = sim_engine()
    ps = prompts(6)
    outs = engine.generate(ps, greedy(12))
    for p, o in zip(ps, outs):
        assert o.output_token_ids == expected(p, 12)
        assert o.finished and o.finish_reason == "length"
    engine.kv.check_invariants()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_shared_prefix_hits_the_cache():
    engine = sim_engine()
    prefix = list(range(100, 120))  # 5 full blocks of 4
    a, b = prefix + [1, 2], prefix + [3]
    engine.generate([a], greedy(3))
    (out,) = engine.generate([b], greedy(5))
    assert out.num_cached_tokens == 20
    assert out.output_token_ids == expected(b, 5)
    m = engine.metrics()
    assert m["prefix_cache_hits"] == 20 and m["prefix_cache_queries"] == len(a) + len(b)


def test_whole_prompt_hit_copies_the_last_block_before_writing_it():
    engine = sim_engine()
    p = list(range(200, 216))  # exactly 4 blocks
    engine.generate([p], greedy(2))
    (out,) = engine.generate([p], greedy(6))
    assert out.num_cached_tokens == 15  # the last token is recomputed, in a copy
    assert out.output_token_ids == expected(p, 6)


def test_copy_on_write_is_load_bearing():
    """Without the copy the recomputed last slot reads garbage: the test above can fail."""
    engine = sim_engine()
    engine.runner.copy_blocks = lambda mapping: None
    p = list(range(200, 216))
    engine.generate([p], greedy(2))
    (out,) = engine.generate([p], greedy(6))
    assert out.output_token_ids != expected(p, 6)


def test_chunked_prefill_under_a_small_token_budget():
    engine = sim_engine(max_num_batched_tokens=5)
    ps = [list(range(1, 38)), [7, 8, 9]]
    outs = engine.generate(ps, greedy(4))
    for p, o in zip(ps, outs):
        assert o.output_token_ids == expected(p, 4)
    assert engine.step_count >= 37 // 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_block_pressure_keeps_outputs_exact(mode):
    engine = sim_engine(num_gpu_blocks=24, preemption_mode=mode, enable_prefix_caching=False)
    ps = prompts(8, lo=5, hi=20, seed=1)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(30))
    final = run_all(engine)
    for i, p in enumerate(ps):
        assert final[f"r{i}"].output_token_ids == expected(p, 30)
    m = engine.metrics()
    if mode == "recompute":
        assert m["num_preemptions"] > 0 and m["num_swaps_out"] == 0
    else:
        assert m["num_swaps_out"] > 0 and m["num_swaps_in"] == m["num_swaps_out"]
    # the requests' counts add up to the engine's: recompute preemptions, never swaps
    assert sum(final[f"r{i}"].num_preemptions for i in range(8)) == m["num_preemptions"]


def test_swap_that_copies_nothing_changes_the_output():
    engine = sim_engine()
    engine.runner.swap_in = lambda mapping: None
    p = list(range(300, 311))
    engine.add_request("x", p, greedy(10))
    for _ in range(4):
        engine.step()
    engine.swap_out("x")
    engine.runner.gpu_cache[:] = [0] * len(engine.runner.gpu_cache)  # the device was wiped
    engine.swap_in("x")
    out = run_all(engine)["x"]
    assert out.output_token_ids != expected(p, 10)


def test_operator_commands_mid_decode():
    engine = sim_engine(enable_prefix_caching=False)
    p = list(range(1, 14))
    engine.add_request("a", p, greedy(20))
    engine.add_request("b", p[::-1], greedy(20))
    for _ in range(5):
        engine.step()
    res = engine.swap_out("a")
    assert res["status"] == "swapped" and res["num_blocks"] > 0
    assert engine.scheduler.requests["a"].status.value == "swapped"
    for _ in range(3):  # parked: stays swapped while others run
        engine.step()
        assert engine.scheduler.requests["a"].status.value == "swapped"
    engine.runner.gpu_cache[:] = [0] * len(engine.runner.gpu_cache)  # swap-in restores all
    engine.swap_in("a")
    engine.preempt("b")
    assert engine.scheduler.requests["b"].status.value == "waiting"
    final = run_all(engine)
    assert final["a"].output_token_ids == expected(p, 20)
    assert final["b"].output_token_ids == expected(p[::-1], 20)
    # one meaning of each count for a request and the engine: a swapped, b preempted
    assert final["a"].num_preemptions == 0 and final["b"].num_preemptions == 1
    m = engine.metrics()
    assert (m["num_swaps_out"], m["num_swaps_in"], m["num_preemptions"]) == (1, 1, 1)
    assert m["preemptions_by_reason"] == {"operator": 1}


def test_operator_errors_are_typed():
    engine = sim_engine(num_cpu_blocks=0)
    engine.add_request("a", [1, 2, 3], greedy(5))
    with pytest.raises(UnknownRequestError):
        engine.preempt("nope")
    with pytest.raises(InvalidStateError, match="waiting"):
        engine.swap_out("a")
    engine.step()
    with pytest.raises(InvalidStateError, match="running"):
        engine.swap_in("a")
    with pytest.raises(NotEnoughBlocksError, match="disabled"):
        engine.swap_out("a")
    run_all(engine)
    with pytest.raises(InvalidStateError, match="finished"):
        engine.abort("a")


def test_swap_out_refused_when_cpu_pool_is_full():
    engine = sim_engine(num_cpu_blocks=2)
    engine.add_request("a", list(range(1, 20)), greedy(5))
    engine.step()
    with pytest.raises(NotEnoughBlocksError, match="CPU blocks"):
        engine.swap_out("a")
    assert engine.scheduler.requests["a"].status.value == "running"
    engine.kv.check_invariants()


def test_abort_anywhere_releases_blocks_and_reports():
    engine = sim_engine()
    for rid in "abc":
        engine.add_request(rid, list(range(1, 10)), greedy(50))
    engine.step()
    engine.swap_out("b")
    out = engine.abort("b")
    assert out.finished and out.finish_reason == "abort"
    engine.abort("a")
    assert engine.kv.cpu.num_free == engine.kv.cpu.num_blocks
    reported = [o.request_id for o in engine.step() if o.finished]
    assert set(reported) >= {"a", "b"}
    engine.abort("c")
    run_all(engine)
    engine.kv.check_invariants()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_priority_policy_admits_the_most_important_first():
    engine = sim_engine(scheduling_policy="priority", max_num_seqs=1)
    engine.add_request("low", [1, 2], greedy(2), priority=5)
    engine.add_request("high", [3, 4], greedy(2), priority=0)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["high"]


def test_max_num_seqs_bounds_the_batch():
    engine = sim_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", [i + 1, 2, 3], greedy(10))
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3


def test_stop_token_ids_end_the_request():
    engine = sim_engine()
    p = [5, 6, 7]
    want = expected(p, 10)
    (out,) = engine.generate([p], SamplingParams(max_tokens=10, stop_token_ids=[want[3]]))
    assert out.output_token_ids == want[:want.index(want[3]) + 1]
    assert out.finish_reason == "stop"


def test_pin_survives_eviction_and_pressure():
    engine = sim_engine(num_gpu_blocks=16)
    prefix = list(range(500, 512))  # 3 blocks
    engine.generate([prefix + [1]], greedy(1))
    res = engine.pin_prefix(prefix)
    assert len(res["block_ids"]) == 3 and res["num_newly_pinned"] == 3
    assert engine.evict_cached_blocks() == 0  # every cached block is a pinned one
    engine.generate(prompts(3, lo=20, hi=40, seed=3), greedy(8))  # pressure
    (out,) = engine.generate([prefix + [9]], greedy(2))
    assert out.num_cached_tokens == 12
    snap = engine.snapshot()
    states = decode_array(snap["gpu"]["state"])
    assert sum(states == 3) == 3
    engine.unpin_prefix(prefix)
    engine.evict_cached_blocks()
    with pytest.raises(PrefixNotCachedError):
        engine.pin_prefix(prefix)
    engine.kv.check_invariants()


def test_a_request_that_only_fits_without_the_pinned_blocks_is_refused():
    """16 blocks of 4 tokens, 4 of them pinned: a request needing 13 could never hold them
    all (it would preempt itself for ever); one whose prompt starts with the pinned
    prefix shares those blocks, and runs."""
    engine = sim_engine(num_gpu_blocks=16)
    prefix = list(range(500, 516))  # 4 blocks
    engine.generate([prefix + [1]], greedy(1))
    engine.pin_prefix(prefix)
    with pytest.raises(InvalidRequestError, match="4 are pinned"):
        engine.add_request("big", list(range(600, 620)), greedy(30))  # 50 tokens: 13 blocks
    (out,) = engine.generate([prefix + list(range(600, 604))], greedy(30))
    assert out.output_token_ids == expected(prefix + list(range(600, 604)), 30)
    assert out.num_preemptions == 0
    engine.add_request("fits", list(range(600, 620)), greedy(24))  # 44 tokens: 11 blocks
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_invariants()


def test_pins_stay_within_the_pin_budget_which_an_operator_changes_live():
    """16 blocks, a budget of a quarter: 4 pinned blocks fit, a fifth does not (refused,
    nothing pinned, the budget named); raised live, it does; lowered, what is pinned
    stays and a new pin is refused."""
    engine = sim_engine(num_gpu_blocks=16, pin_budget=0.25)
    first, second = list(range(500, 516)), list(range(800, 808))  # 4 blocks, 2 blocks
    engine.generate([first + [1], second + [1]], greedy(1))
    assert engine.pin_prefix(first)["num_newly_pinned"] == 4
    with pytest.raises(NotEnoughBlocksError, match="over the pin budget of 4 blocks"):
        engine.pin_prefix(second)
    assert engine.kv.gpu.num_pinned == 4
    assert engine.pin_prefix(first)["num_newly_pinned"] == 0  # (again: nothing new)
    assert engine.set_retention(pin_budget=0.5) == {
        "pin_budget": 0.5, "pin_budget_blocks": 8, "num_pinned_blocks": 4,
        "eviction_policy": "lru", "tenant_cache_quota": 1.0}
    assert engine.pin_prefix(second)["num_newly_pinned"] == 2
    engine.set_retention(pin_budget=0.0)
    assert engine.kv.gpu.num_pinned == 6 and engine.metrics()["pin_budget"] == 0.0
    engine.unpin_prefix(second)
    with pytest.raises(NotEnoughBlocksError, match="pin budget of 0 blocks"):
        engine.pin_prefix(second)
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(InvalidRequestError):
            engine.set_retention(pin_budget=bad)
    engine.kv.check_invariants()


@pytest.mark.parametrize("policy, kept", [("lru", False), ("slru", True), ("lfu", True)])
def test_a_prefix_that_came_back_outlives_a_scan_of_one_off_prompts(policy, kept):
    """A prompt asked twice, then one-off prompts that need more blocks than are free:
    LRU lets the prompt's blocks go first (the least recently freed); SLRU and LFU keep
    them (they were hit) and let the one-off prompts' go."""
    engine = sim_engine(num_gpu_blocks=24, eviction_policy=policy)
    first = list(range(500, 516))  # 4 blocks
    engine.generate([first + [1]], greedy(2))
    assert engine.generate([first + [2]], greedy(2))[0].num_cached_tokens == 16
    for p in prompts(8, lo=20, hi=20, seed=12):  # one at a time: 6 blocks each
        engine.generate([p], greedy(4))
    (again,) = engine.generate([first + [3]], greedy(2))
    assert (again.num_cached_tokens == 16) is kept
    assert again.output_token_ids == expected(first + [3], 2)
    engine.kv.check_invariants()


def test_the_priority_policy_keeps_an_important_requests_prefix():
    first = list(range(500, 516))

    def after_a_flood(**policy):
        """An important request's prefix, ten ordinary prompts, then the prefix again:
        the engine, and how many of its tokens were still cached."""
        engine = sim_engine(num_gpu_blocks=24, scheduling_policy="priority", **policy)
        engine.add_request("vip", first + [1], greedy(2), priority=-1)
        run_all(engine)
        for p in prompts(10, lo=20, hi=20, seed=13):
            engine.generate([p], greedy(4))
        engine.add_request("again", first + [2], greedy(2))
        return engine, run_all(engine)["again"].num_cached_tokens

    engine, cached = after_a_flood(eviction_policy="priority")
    assert cached == 16
    assert after_a_flood()[1] == 0  # the same under LRU: gone
    assert engine.set_retention(eviction_policy="lfu")["eviction_policy"] == "lfu"
    with pytest.raises(InvalidRequestError, match="eviction_policy"):
        engine.set_retention(eviction_policy="mru")
    engine.kv.check_invariants()


def test_a_soft_pinned_prefix_outlives_a_scan_and_lapses_with_its_time():
    """A soft pin keeps a prefix through one-off prompts that LRU would let it go for;
    past its time to live it is evicted like any other; it counts against no budget and
    never stops a request from running."""
    engine = sim_engine(num_gpu_blocks=24, pin_budget=0.0)
    clock = [1000.0]
    engine.kv.gpu.clock = lambda: clock[0]
    first = list(range(500, 516))  # 4 blocks
    engine.generate([first + [1]], greedy(2))
    res = engine.pin_prefix(first, soft=True, priority=0, ttl_s=60)
    assert res["soft"] and res["num_newly_pinned"] == 4
    assert engine.metrics()["num_soft_pinned_blocks"] == 4
    for p in prompts(8, lo=20, hi=20, seed=12):
        engine.generate([p], greedy(4))
    (kept,) = engine.generate([first + [2]], greedy(2))
    assert kept.num_cached_tokens == 16  # (the hit renewed it too)
    clock[0] += 61
    for p in prompts(8, lo=20, hi=20, seed=14):
        engine.generate([p], greedy(4))
    (gone,) = engine.generate([first + [3]], greedy(2))
    assert gone.num_cached_tokens == 0 and gone.output_token_ids == expected(first + [3], 2)
    assert engine.metrics()["num_soft_pinned_blocks"] == 0
    # a request that needs every block runs with soft pins in place
    engine.generate([first + [1]], greedy(2))
    engine.pin_prefix(first, soft=True, ttl_s=600)
    (big,) = engine.generate([list(range(600, 680))], greedy(10))  # 90 tokens: 23 blocks
    assert big.output_token_ids == expected(list(range(600, 680)), 10)
    with pytest.raises(PrefixNotCachedError):  # (evicted for it)
        engine.unpin_prefix(first, soft=True)
    engine.kv.check_invariants()


def test_a_pin_that_would_starve_a_request_already_there_is_refused():
    engine = sim_engine(num_gpu_blocks=16)
    prefix = list(range(500, 516))
    engine.generate([prefix + [1]], greedy(1))
    engine.add_request("long", list(range(700, 720)), greedy(30))  # 13 blocks, unrelated
    engine.step()
    with pytest.raises(NotEnoughBlocksError, match="request long needs 13"):
        engine.pin_prefix(prefix)
    assert engine.kv.gpu.num_pinned == 0
    while engine.has_unfinished_requests():
        engine.step()
    pinned = engine.pin_prefix(prefix)["block_ids"]  # nobody left to starve (what the
    assert engine.kv.gpu.num_pinned == len(pinned) > 0  # long request left cached of it)
    engine.reset_prefix_cache()
    assert engine.kv.gpu.num_pinned == 0
    engine.kv.check_invariants()


def test_evict_and_reset_drop_cached_blocks():
    engine = sim_engine()
    engine.generate([list(range(40))], greedy(1))
    cached = len(engine.kv.gpu.cached)
    assert cached == 10
    assert engine.evict_cached_blocks(3) == 3
    assert len(engine.kv.gpu.cached) == 7
    res = engine.reset_prefix_cache()
    assert res["num_blocks_forgotten"] == 7 and not engine.kv.gpu.cached
    (out,) = engine.generate([list(range(40))], greedy(1))
    assert out.num_cached_tokens == 0
    with pytest.raises(InvalidRequestError):
        engine.evict_cached_blocks(-1)


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "-1", "x"])
def test_a_logit_bias_key_that_is_no_token_id_is_refused_naming_it(key):
    """JSON's string keys are token ids only in ASCII digits ("²".isdigit() is True in
    Python, and int("²") raises): anything else is an InvalidRequestError, not a crash."""
    with pytest.raises(InvalidRequestError, match="logit_bias keys"):
        SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={"12": 1.0}).logit_bias == {12: 1.0}


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"), ([1, 2, 10_000], r"\[0, 1000\)"), ("", "empty"), (None, "string or a list"),
    (list(range(1, 300)), "limit"),
])
def test_bad_prompts_are_refused(prompt, message):
    engine = sim_engine(max_model_len=256, num_gpu_blocks=128)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("x", prompt, greedy(1))
    assert not engine.has_unfinished_requests()


def test_duplicate_id_and_oversized_request_are_refused():
    engine = sim_engine(num_gpu_blocks=8)
    engine.add_request("x", [1], greedy(1))
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.add_request("x", [1], greedy(1))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        engine.add_request("y", [1] * 20, greedy(30))


def test_snapshot_format():
    engine = sim_engine()
    engine.add_request("a", list(range(1, 11)), greedy(5), job_id="job-1")
    engine.add_request("b", list(range(1, 9)), greedy(5))
    engine.step()
    snap = engine.snapshot()
    json.dumps(snap)
    assert snap["config"]["num_gpu_blocks"] == 64 and snap["config"]["block_size"] == 4
    for key in ("state", "ref_cnt", "owner"):
        assert len(snap["gpu"][key]) == 64 and len(snap["cpu"][key]) == 64
    by_id = {r["request_id"]: r for r in snap["requests"]}
    a = by_id["a"]
    assert a["status"] == "running" and a["job_id"] == "job-1"
    assert len(a["block_table"]) == 3 and a["cpu_block_table"] == []
    owner = snap["gpu"]["owner"]
    assert all(owner[blk] == a["index"] for blk in a["block_table"])
    # b's 8 tokens are a's first two blocks, cached by a in this same step: b shares the
    # first; the second would need a copy of data not written yet, so b recomputes it.
    ref = snap["gpu"]["ref_cnt"]
    b = by_id["b"]
    assert b["num_cached_tokens"] == 4
    assert b["block_table"][0] == a["block_table"][0] and ref[a["block_table"][0]] == 2
    assert b["block_table"][1] != a["block_table"][1] and ref[a["block_table"][1]] == 1
    compact = engine.snapshot(compact=True)
    for key in ("state", "ref_cnt", "owner", "hash32"):
        assert list(decode_array(compact["gpu"][key])) == list(decode_array(snap["gpu"][key]))
    assert set(snap["metrics"]) >= {
        "kv_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
        "num_swaps_out", "num_swaps_in", "running", "waiting", "swapped",
        "prompt_tokens_per_s", "generation_tokens_per_s"}
    assert compact["seq"] > snap["seq"]


def test_finished_requests_show_with_empty_tables():
    engine = sim_engine()
    engine.generate([[1, 2, 3]], greedy(2))
    snap = engine.snapshot()
    (entry,) = snap["requests"]
    assert entry["status"] == "finished" and entry["block_table"] == []


def test_events_describe_what_happened():
    engine = sim_engine()
    p = list(range(1, 13))
    engine.generate([p], greedy(1))
    engine.generate([p + [5]], greedy(1))
    types = [e.type for e in engine.take_events()]
    for t in ("BlockStored", "BlockRemoved", "PrefixHit", "Finished"):
        assert t in types
    assert engine.take_events() == []


def test_step_with_nothing_to_do_returns_empty():
    engine = sim_engine()
    assert engine.step() == []
    assert engine.step_count == 0 and engine.step_seconds == 0.0


def test_step_seconds_count_the_steps_that_ran():
    """The mean step time an operator reads (kvops:engine_step_seconds over
    kvops:engine_steps): a paced simulated step lasts at least its pace, so the total is
    at least steps x pace; steps with nothing to do add nothing."""
    engine = sim_engine(simulate_step_ms=2.0)
    engine.generate(prompts(3), greedy(5))
    m = engine.metrics()
    assert m["num_steps"] == engine.step_count >= 5
    assert m["step_seconds"] == engine.step_seconds >= engine.step_count * 0.002
    before = engine.step_seconds
    assert engine.step() == []
    assert engine.step_seconds == before


def test_a_failed_step_ends_its_batch_and_leaks_nothing():
    engine = sim_engine()
    engine.add_request("a", list(range(1, 30)), greedy(10))
    engine.step()
    real_forward = engine.runner.forward

    def broken(out):
        raise RuntimeError("injected")

    engine.runner.forward = broken
    engine.add_request("b", list(range(1, 30)), greedy(10))  # would hit a's blocks
    with pytest.raises(RuntimeError):
        engine.step()
    ended = engine.recover_from_failed_step()
    assert sorted(ended) == ["a", "b"]
    engine.kv.check_invariants()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks
    engine.runner.forward = real_forward
    p = list(range(1, 30))
    (out,) = engine.generate([p], greedy(5))
    assert out.output_token_ids == expected(p, 5)  # nothing stale was left in the cache


def test_cache_salts_keep_users_apart_but_share_pinned_prefixes():
    """A salted request never hits another salt's (or the unsalted) cache, so it cannot
    learn what others sent; blocks an operator pinned (unsalted) are shared with all."""
    engine = sim_engine()
    secret = list(range(300, 324))  # 6 blocks
    engine.generate([secret + [1]], greedy(1))  # unsalted: another user's, say
    engine.add_request("b1", secret + [2], greedy(1), cache_salt="user-b")
    engine.add_request("a2", secret + [3], greedy(1), cache_salt="user-a")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["b1"].num_cached_tokens == 0 and done["a2"].num_cached_tokens == 0
    engine.add_request("a3", secret + [4], greedy(1), cache_salt="user-a")  # its own: a hit
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a3"].num_cached_tokens == 24

    system = list(range(900, 916))  # 4 blocks, published by an operator
    engine.generate([system + [5]], greedy(1))
    engine.pin_prefix(system)
    engine.add_request("b2", system + [6, 7], greedy(3), cache_salt="user-b")
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["b2"].num_cached_tokens == 16
    assert done["b2"].output_token_ids == expected(system + [6, 7], 3)
    engine.kv.check_invariants()


def test_pause_holds_every_request_and_its_blocks_until_resume():
    engine = sim_engine()
    ps = prompts(3, lo=10, hi=20, seed=7)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(10))
    engine.step()
    held = {f"r{i}": engine.kv.block_ids(f"r{i}") for i in range(3)}
    steps = engine.step_count
    assert engine.pause()["state"] == "paused" and engine.metrics()["state"] == "paused"
    engine.add_request("late", ps[0], greedy(10))  # waits
    assert engine.step() == [] and engine.step_count == steps
    assert not engine.has_work_to_run() and engine.has_unfinished_requests()
    assert {r: engine.kv.block_ids(r) for r in held} == held  # KV kept
    engine.abort("r2")  # still ends, and is reported though paused
    assert engine.has_work_to_run()
    (aborted,) = engine.step()
    assert aborted.request_id == "r2" and aborted.finished and engine.step_count == steps
    engine.resume()
    final = run_all(engine)
    assert final["r0"].output_token_ids == expected(ps[0], 10) == final["late"].output_token_ids
    assert final["r1"].output_token_ids == expected(ps[1], 10)
    assert engine.metrics()["state"] == "ready"


def test_drain_reports_draining_until_the_last_request_ends():
    engine = sim_engine()
    engine.add_request("r", prompts(1, seed=8)[0], greedy(6))
    engine.step()
    assert engine.drain()["state"] == "draining" and engine.metrics()["state"] == "draining"
    final = run_all(engine)  # a draining engine still runs what it has
    assert final["r"].finished and engine.metrics()["state"] == "drained"
    assert engine.undrain()["state"] == "ready"
    engine.pause()
    engine.drain()
    assert engine.state == "paused"  # a pause shows first


def test_batch_limits_change_between_steps_within_their_caps():
    engine = sim_engine(max_num_seqs=8, max_num_batched_tokens=64)
    assert engine.set_limits(max_num_seqs=2)["max_num_seqs"] == 2
    for i, p in enumerate(prompts(5, lo=3, hi=6, seed=9)):
        engine.add_request(f"r{i}", p, greedy(4))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 2
    assert engine.set_limits(max_num_seqs=8, max_num_batched_tokens=16)["max_num_batched_tokens"] == 16
    assert engine.describe_config()["max_num_batched_tokens"] == 16
    for bad in ({"max_num_seqs": 9}, {"max_num_seqs": 0}, {"max_num_batched_tokens": 65},
                {"max_num_batched_tokens": 15}, {"max_num_seqs": True}):
        with pytest.raises(InvalidRequestError):
            engine.set_limits(**bad)
    assert engine.config.max_num_seqs == 8  # a refused change changes nothing
