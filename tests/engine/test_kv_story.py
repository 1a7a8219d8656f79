"""The KV story of a request (engine/observe/story.py), in the engine: each first-miss reason
produced by the situation it names, preemptions with their causes, and the bounds."""
from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.sim import greedy, run_all, sim_engine
from tests.support.clock import Clock

BS = 4
A = list(range(10, 30))  # five full blocks


def flood(engine: LLMEngine, n: int, prefix: str = "flood") -> list[str]:
    """n requests of unrelated prompts, run to the end: their blocks take the pool's."""
    ids = [f"{prefix}{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(1000 + 40 * i, 1040 + 40 * i)), greedy(2))
    run_all(engine)
    return ids


def story_of(engine: LLMEngine, rid: str, prompt, **kw) -> dict:
    engine.add_request(rid, prompt, kw.pop("params", greedy(2)), **kw)
    run_all(engine)
    return engine.kv_story(rid)


def small(**kw) -> LLMEngine:
    return sim_engine(**{"num_gpu_blocks": 16, "block_size": BS, "vocab_size": 2000, **kw})


def test_a_full_hit_has_no_first_miss_and_says_where_each_block_came_from():
    engine = small()
    first = story_of(engine, "a1", A)
    assert first["first_miss"]["reason"] == "never_cached"
    assert first["first_miss"]["block"] == 0 and first["cached_tokens"]["gpu"] == 0
    again = story_of(engine, "a2", A)
    assert again["first_miss"] is None
    assert again["hashes"] == first["hashes"] and len(again["hashes"]) == 5
    assert again["sources"] == {"gpu": 5, "cpu": 0, "disk": 0}
    # the last token is always computed: 19 of 20 prompt tokens came from the cache
    assert again["cached_tokens"] == {"gpu": 19, "cpu": 0, "disk": 0}
    moments = again["moments"]
    assert moments["admitted"] <= moments["first_token"] <= moments["ended"]
    assert again["finish_reason"] == "length"


def test_evicted_names_the_request_the_block_was_taken_for():
    engine = small()
    story_of(engine, "a1", A)
    flooders = flood(engine, 4)
    miss = story_of(engine, "a2", A)["first_miss"]
    assert miss["reason"] == "evicted" and miss["block"] == 0
    assert miss["by"] in flooders and miss["at"] is not None
    assert "least recently used" in miss["detail"] and miss["by"] in miss["detail"]


def test_a_reset_and_an_operators_evict_name_the_operator():
    engine = small()
    story_of(engine, "a1", A)
    engine.reset_prefix_cache(by="olive")
    miss = story_of(engine, "a2", A)["first_miss"]
    assert (miss["reason"], miss["by"]) == ("reset", "olive")
    engine.evict_cached_blocks(None, by="oscar")
    miss = story_of(engine, "a3", A)["first_miss"]
    assert (miss["reason"], miss["by"]) == ("operator_evict", "oscar")
    assert "oscar" in miss["detail"]


def test_salt_the_same_tokens_cached_for_another_tenant():
    engine = small()
    story_of(engine, "alice", A, cache_salt="alice-salt")
    miss = story_of(engine, "bob", A, cache_salt="bob-salt")["first_miss"]
    assert miss["reason"] == "salt" and miss["block"] == 0
    # unsalted (staff) against salted, too; and the same salt hits
    assert story_of(engine, "staff", A)["first_miss"]["reason"] == "salt"
    assert story_of(engine, "alice2", A, cache_salt="alice-salt")["first_miss"] is None


def test_window_a_sliding_window_gave_the_block_back():
    # a 16-token window: a 40-token prompt gives its first blocks back while it runs,
    # and they are the first free blocks the next allocations reuse
    engine = small(simulate_sliding_window=16, num_gpu_blocks=20)
    long_prompt = list(range(50, 90))
    story_of(engine, "w1", long_prompt, params=greedy(8))
    flood(engine, 2)
    story = story_of(engine, "w2", long_prompt)
    assert story["first_miss"]["reason"] == "window", story["first_miss"]
    assert "sliding window" in story["first_miss"]["detail"]
    assert engine.kv_story("w1")["window_freed"] > 0


def test_a_hybrid_models_global_layers_cached_but_sliding_ones_given_back():
    # the sliding group gives its early blocks back while the request runs: they are
    # reused first, while the global group's copies (freed at its end) stay cached
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=2000,
                                    block_size=BS, num_gpu_blocks=24, num_cpu_blocks=0,
                                    simulate_sliding_window=8, simulate_hybrid=True,
                                    max_num_batched_tokens=64))
    prompt = list(range(50, 90))
    story_of(engine, "h1", prompt, params=greedy(4))
    for i in range(2):
        story_of(engine, f"x{i}", list(range(500 + 12 * i, 512 + 12 * i)))
    miss = story_of(engine, "h2", prompt)["first_miss"]
    assert miss["reason"] == "window", miss
    assert "sliding-window layers" in miss["detail"]


def test_caching_off():
    off = small(enable_prefix_caching=False)
    story_of(off, "a1", A)
    miss = story_of(off, "a2", A)["first_miss"]
    assert (miss["reason"], miss["block"]) == ("caching_off", 0)
    assert off.kv_story("none") is None


def test_partial_block_the_last_block_holds_the_token_that_is_always_computed():
    # with the CPU tier, a prompt of whole blocks found on the tier leaves its last one
    engine = sim_engine(num_gpu_blocks=12, num_cpu_blocks=32, block_size=BS, vocab_size=2000,
                        cpu_prefix_cache=True)
    story_of(engine, "p1", A)
    flood(engine, 3)
    story = story_of(engine, "p2", A)
    assert story["sources"]["cpu"] == 4 and story["cached_tokens"]["cpu"] > 0
    assert story["first_miss"]["reason"] == "partial_block"
    assert story["first_miss"]["block"] == 4


def test_preemptions_say_why_who_and_what_they_cost():
    engine = sim_engine(num_gpu_blocks=10, block_size=BS, vocab_size=2000,
                        enable_prefix_caching=False, max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(100 * i + 1, 100 * i + 9)), greedy(20))
    run_all(engine)
    preemptions = [p for i in range(3) for p in engine.kv_story(f"r{i}")["preemptions"]]
    assert preemptions, "the pool was to run short"
    p = preemptions[0]
    assert p["reason"] == "kv_full" and p["by"] in {"r0", "r1", "r2"}
    assert p["needed_blocks"] > p["free_blocks"]
    assert p["recomputed_tokens"] > 0

    engine.add_request("op", list(range(1, 9)), greedy(20))
    engine.step()
    engine.preempt("op", by="olive")
    run_all(engine)
    story = engine.kv_story("op")
    [p] = story["preemptions"]
    assert (p["reason"], p["by"]) == ("operator", "olive")
    assert story["moments"]["preemptions"] == [p["at"]]


def test_swaps_are_told_as_swaps_with_the_blocks_moved():
    engine = sim_engine(num_gpu_blocks=10, num_cpu_blocks=32, block_size=BS, vocab_size=2000,
                        enable_prefix_caching=False, preemption_mode="swap")
    for i in range(3):
        engine.add_request(f"s{i}", list(range(100 * i + 1, 100 * i + 9)), greedy(20))
    run_all(engine)
    stories = [engine.kv_story(f"s{i}") for i in range(3)]
    swaps = [s for story in stories for s in story["swaps"]]
    outs = [s for s in swaps if s["direction"] == "out"]
    assert outs and all(s["blocks"] > 0 and s["reason"] == "kv_full" for s in outs)
    # the scheduler brought each back once blocks were free: no operator's doing
    assert [s for s in swaps if s["direction"] == "in"] and \
        all(s["reason"] is None and s["by"] is None for s in swaps if s["direction"] == "in")
    # a swap is no preemption (engine/sched/scheduler.py, above SchedulerCounters)
    assert not any(story["preemptions"] for story in stories)
    m = engine.metrics()
    assert m["num_preemptions"] == sum(m["preemptions_by_reason"].values()) == 0
    assert m["num_swaps_out"] == len(outs)


def test_an_operators_swap_out_and_in_are_swaps_and_agree_with_the_counts():
    engine = sim_engine(num_gpu_blocks=32, num_cpu_blocks=32, block_size=BS, vocab_size=2000,
                        enable_prefix_caching=False)
    engine.add_request("w", list(range(1, 14)), greedy(30))
    for _ in range(3):
        engine.step()
    engine.preempt("w", by="olive")
    for _ in range(3):
        engine.step()
    engine.swap_out("w", by="olive")
    engine.step()
    engine.swap_in("w", by="olive")
    request = engine.scheduler.requests["w"]
    story = engine.kv_story("w")
    assert [p["reason"] for p in story["preemptions"]] == ["operator"]
    assert [(s["direction"], s["reason"], s["by"]) for s in story["swaps"]] == \
        [("out", "operator", "olive"), ("in", "operator", "olive")]
    m = engine.metrics()
    # one count per concept: the request's, the engine's and the story's agree
    assert request.num_preemptions == m["num_preemptions"] == len(story["preemptions"]) == 1
    assert request.num_swaps_out == m["num_swaps_out"] == m["num_swaps_in"] == 1


def test_the_story_keeps_the_blocks_held_at_the_end_hits_and_computed():
    engine = small()
    story_of(engine, "a1", A)
    engine.add_request("a2", A, greedy(3))  # a prefix hit on a1's blocks
    held = []  # its table before its last step (which may add a block)
    while engine.has_unfinished_requests():
        if "a2" in engine.scheduler.requests:
            held = engine.kv.block_ids("a2")
        engine.step()
    story = engine.kv_story("a2")
    assert story["sources"]["gpu"] == 5  # it was a hit: its first 5 blocks are a1's
    final = story["final_blocks"]
    assert final["cpu"] == [] and len(held) >= 5
    assert final["gpu"][:len(held)] == held and len(final["gpu"]) <= len(held) + 1


def test_the_final_blocks_of_a_request_preempted_then_ended_waiting_are_none():
    engine = small()
    engine.add_request("p", A, greedy(30))
    for _ in range(3):
        engine.step()
    engine.preempt("p")
    engine.abort("p")
    engine.step()
    assert engine.kv_story("p")["final_blocks"] == {"gpu": [], "cpu": []}


def test_forked_samples_carry_the_story_and_count_their_copies_on_write():
    engine = small()
    engine.add_request("f", A[:18], SamplingParams(n=3, max_tokens=3, temperature=0.0))
    run_all(engine)
    stories = [engine.kv_story(f"f/{i}") for i in range(3)]
    assert all(s is not None and s["prompt_tokens"] == 18 for s in stories)
    assert sum(s["copy_on_write"] for s in stories) >= 2
    assert all(s["moments"]["first_token"] for s in stories)
    # nothing of the parent is left waiting (it never produces a token of its own)
    assert not engine.stories.awaiting_first_token and not engine.stories.changed


def test_a_hash_older_than_the_history_is_unknown_not_never_cached():
    engine = small(kv_history_blocks=4, num_gpu_blocks=32)
    story_of(engine, "a1", A)
    flood(engine, 6)  # pushes a1's records out of a 4-hash history (and its blocks out)
    miss = story_of(engine, "a2", A)["first_miss"]
    assert miss["reason"] == "unknown" and "history" in miss["detail"]


def test_no_history_no_stories():
    engine = small(kv_history_blocks=0)
    assert story_of(engine, "a", A) is None


def test_outputs_carry_the_story_when_it_changes():
    engine = small()
    engine.add_request("o", A, greedy(3))
    stories = []
    while engine.has_unfinished_requests():
        stories += [o.kv_story for o in engine.step_core() if o.kv_story is not None]
    assert stories[0]["first_miss"]["reason"] == "never_cached"
    assert stories[-1]["finish_reason"] == "length"
    assert len(stories) <= 3  # admitted (with its first token), ended: not every step


def test_metrics_count_misses_by_reason_preemptions_by_reason_and_residency():
    engine = small(kv_metrics_sample=1.0)
    clock = engine.events.clock = Clock(100.0)  # the events' time: residency in exact seconds
    story_of(engine, "a1", A)  # never cached: 20 tokens computed, 5 blocks stored at 100
    clock.now = 110.0
    story_of(engine, "a2", A)  # a full hit: the last token computed
    clock.now = 130.0
    flood(engine, 4)  # evicts a1's blocks, and its own: stored and evicted at 130
    before = engine.metrics()
    clock.now = 160.0
    story_of(engine, "a3", A)  # evicted; takes the flood's blocks, none hit since 130
    m = engine.metrics()
    missed = m["missed_tokens_by_reason"]
    assert missed["evicted"] == 20 and missed["partial_block"] == 1
    assert missed["never_cached"] == 20 + 4 * 40  # a1 and the flood
    lifetime, idle = m["kv_block_lifetime_seconds"], m["kv_block_idle_before_evict_seconds"]
    assert len(lifetime["counts"]) == len(lifetime["bounds"]) + 1
    # by the flood's end: a1's 5 blocks lived 30 s, the last 20 of them after a2's hit
    assert before["kv_block_lifetime_seconds"]["sum"] == 5 * 30
    assert before["kv_block_idle_before_evict_seconds"]["sum"] == 5 * 20
    # then those a3 evicted, each 30 s after the flood stored (or last hit) it
    by_a3 = sum(lifetime["counts"]) - sum(before["kv_block_lifetime_seconds"]["counts"])
    assert by_a3 > 0 and sum(idle["counts"]) == sum(lifetime["counts"])
    assert lifetime["sum"] == 5 * 30 + by_a3 * 30 and idle["sum"] == 5 * 20 + by_a3 * 30
    # a2 hit a1's 5 blocks 10 s after they were stored (and preempted flood requests
    # their own, on their return, at once)
    gaps = m["kv_block_reuse_gap_seconds"]
    assert sum(gaps["counts"]) > 5 and gaps["sum"] == 5 * 10

    pressed = sim_engine(num_gpu_blocks=10, block_size=BS, vocab_size=2000,
                         enable_prefix_caching=False)
    for i in range(3):
        pressed.add_request(f"r{i}", list(range(100 * i + 1, 100 * i + 9)), greedy(20))
    run_all(pressed)
    by_reason = pressed.metrics()["preemptions_by_reason"]
    assert by_reason["kv_full"] == pressed.metrics()["num_preemptions"] > 0
