"""Token-weighted fairness (EngineConfig.fairness = "vtc", engine/sched/fairness.py):
the tenant served the fewest weighted tokens is admitted first, priorities still win, a
tenant back from idle joins at the least counter, and outputs stay the reference's."""
import pytest

from engine.errors import InvalidRequestError
from engine.sched.fairness import LIFT_UNDER, OUTPUT_WEIGHT, PROMPT_WEIGHT
from engine.sched.scheduler import DEFERRED_FLOOR
from tests.engine.sim import expected, greedy, run_all, sim_engine


def admission_order(engine) -> list[str]:
    """Step until idle; the order in which requests first ran."""
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        for request in engine.scheduler.running:
            if request.request_id not in order:
                order.append(request.request_id)
    return order


def heavy_and_light(fairness: str, **config) -> tuple[object, list[str], dict]:
    """A's three long prompts, then B's four short ones, all queued at once."""
    engine = sim_engine(max_num_seqs=1, num_gpu_blocks=256, fairness=fairness, **config)
    prompts = {}
    for i in range(3):
        prompts[f"a{i}"] = [10 + i] * 100
    for i in range(4):
        prompts[f"b{i}"] = [50 + i] * 5
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(5), tenant=rid[0].upper())
    return engine, admission_order(engine), prompts


def test_vtc_serves_the_lighter_tenant_first():
    engine, order, _ = heavy_and_light("vtc")
    # a0 (both at 0: the queue's first), then B's four (5 + 2*5 = 15 tokens each, 60 in
    # all, under A's 100 + 2*5), then A's rest
    assert order == ["a0", "b0", "b1", "b2", "b3", "a1", "a2"]
    served = engine.scheduler.vtc.served
    assert served["A"] == 3 * (100 * PROMPT_WEIGHT + 5 * OUTPUT_WEIGHT)
    assert served["B"] == 4 * (5 * PROMPT_WEIGHT + 5 * OUTPUT_WEIGHT)


def test_the_share_policy_keeps_arrival_order():
    _, order, _ = heavy_and_light("share")
    assert order == ["a0", "a1", "a2", "b0", "b1", "b2", "b3"]


def test_outputs_are_the_references_under_vtc():
    engine = sim_engine(max_num_seqs=1, num_gpu_blocks=256, fairness="vtc")
    prompts = {f"{t}{i}": [20 + i + (40 if t == "b" else 0)] * (9 if t == "a" else 3)
               for t in "ab" for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(6), tenant=rid[0])
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert {rid: o.output_token_ids for rid, o in final.items()} == \
        {rid: expected(p, 6) for rid, p in prompts.items()}


def test_a_weight_slows_a_tenants_counter():
    weighted = sim_engine(max_num_seqs=1, num_gpu_blocks=256, fairness="vtc")
    weighted.set_tenant("A", weight=10.0)
    assert weighted.tenant_limits("A")["weight"] == 10.0
    for i in range(3):
        weighted.add_request(f"a{i}", [10 + i] * 100, greedy(5), tenant="A")
    for i in range(4):
        weighted.add_request(f"b{i}", [50 + i] * 5, greedy(5), tenant="B")
    # A's 110 tokens count 11: after a0, b0 (15) puts B past A; A and B alternate
    assert admission_order(weighted) == ["a0", "b0", "a1", "b1", "a2", "b2", "b3"]


def test_priorities_win_over_the_counter():
    engine = sim_engine(max_num_seqs=1, num_gpu_blocks=256, fairness="vtc",
                        scheduling_policy="priority")
    engine.add_request("a0", [10] * 100, greedy(5), tenant="A")
    engine.add_request("b0", [50] * 5, greedy(5), tenant="B", priority=1)
    engine.add_request("a1", [11] * 100, greedy(5), tenant="A", priority=0)
    engine.add_request("b1", [51] * 5, greedy(5), tenant="B", priority=0)
    assert admission_order(engine) == ["a0", "b1", "a1", "b0"]


def test_a_tenant_back_from_idle_joins_at_the_least_counter():
    engine = sim_engine(max_num_seqs=2, num_gpu_blocks=256, fairness="vtc")
    engine.add_request("a0", [10] * 50, greedy(5), tenant="A")
    engine.add_request("b0", [20] * 30, greedy(5), tenant="B")
    while engine.has_unfinished_requests():
        engine.step()
    vtc = engine.scheduler.vtc
    engine.add_request("a1", [11] * 10, greedy(50), tenant="A")
    engine.add_request("b1", [21] * 10, greedy(50), tenant="B")
    engine.step()
    engine.add_request("c0", [30] * 10, greedy(5), tenant="C")  # new: lifted
    assert vtc.served["C"] == min(vtc.served["A"], vtc.served["B"]) - LIFT_UNDER > 0
    before = vtc.served["A"]
    engine.add_request("a2", [12] * 10, greedy(5), tenant="A")  # active: not lifted
    assert vtc.served["A"] == before


def test_a_tenant_back_from_idle_goes_first_among_equals():
    """A's a0 holds the only seat; B's b1 waits, B lifted under A's counter; then C, back
    from idle, is lifted to just under B's, the least: when a0 ends C's request goes
    before B's older one (level, a tie would go to the request that waited longest)."""
    engine = sim_engine(max_num_seqs=1, num_gpu_blocks=256, fairness="vtc")
    engine.add_request("b0", [20] * 10, greedy(2), tenant="B")
    run_all(engine)
    engine.add_request("a0", [10] * 30, greedy(20), tenant="A")
    engine.step()
    engine.add_request("b1", [21] * 10, greedy(5), tenant="B")
    engine.add_request("c1", [31] * 10, greedy(5), tenant="C")
    vtc = engine.scheduler.vtc
    assert vtc.served_of("B") == vtc.served_of("A") - LIFT_UNDER
    assert vtc.served_of("C") == vtc.served_of("B") - LIFT_UNDER
    assert admission_order(engine) == ["a0", "c1", "b1"]


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1e9])
def test_a_bad_weight_is_refused(bad):
    engine = sim_engine(fairness="vtc")
    with pytest.raises(InvalidRequestError, match="weight"):
        engine.set_tenant("A", weight=bad)


def pool_held_by_b(fairness: str, a1_priority: int = 0, **config):
    """A's a0 runs throughout (A stays active, its counter small); B's two 64-token
    prompts hold most of the 48-block pool; then A's a1 (60 tokens: 15 blocks) arrives,
    more than the free blocks. Returns the engine, a1's first running step and B's
    requests still running then."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=48, num_cpu_blocks=0,
                        fairness=fairness, **config)
    engine.add_request("a0", [9] * 4, greedy(40), tenant="A")
    engine.add_request("b0", [50] * 64, greedy(8), tenant="B")
    engine.add_request("b1", [51] * 64, greedy(8), tenant="B", priority=0)
    for _ in range(4):
        engine.step()
    assert engine.kv.gpu.num_free < 15  # a1 does not fit beside B's requests
    engine.add_request("a1", [10] * 60, greedy(5), tenant="A", priority=a1_priority)
    step, first, b_running = 0, None, None
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.kv.check_invariants()
        step += 1
        running = {r.request_id for r in engine.scheduler.running}
        if first is None and "a1" in running:
            first, b_running = step, running & {"b0", "b1"}
    prompts = {"a0": ([9] * 4, 40), "b0": ([50] * 64, 8), "b1": ([51] * 64, 8),
               "a1": ([10] * 60, 5)}
    assert {rid: o.output_token_ids for rid, o in final.items()} == \
        {rid: expected(p, n) for rid, (p, n) in prompts.items()}
    return engine, first, b_running


def test_vtc_preempts_the_heavier_tenants_newest_request_for_the_lighters_blocks():
    engine, first, b_running = pool_held_by_b("vtc")
    # a1 ran in the first step after it arrived, beside B's older request; B's newest
    # gave way (and was recomputed: the outputs are the reference's)
    assert first == 1 and b_running == {"b0"}
    assert engine.scheduler.counters.preemptions_by_reason == {"fairness": 1}
    preempted = [e for e in engine.take_events() if e.type == "Preempted"]
    assert [(e.request_id, e.reason, e.by) for e in preempted] == [("b1", "fairness", "a1")]


def test_a_fairness_preemption_names_the_blocks_the_admission_takes():
    """a1 finds its first 8 blocks cached and free (a0's, ended): its admission takes
    those and 15 new ones, 23 of the free blocks; B's newest gives way, and the event
    says 23 needed (not the 15 its uncached tokens fill)."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=48, num_cpu_blocks=0, fairness="vtc")
    engine.add_request("a0", [10] * 32 + [9], greedy(2), tenant="A")
    run_all(engine)
    engine.add_request("a2", [9] * 4, greedy(40), tenant="A")  # A stays active
    engine.add_request("b0", [50] * 64, greedy(8), tenant="B")
    engine.add_request("b1", [51] * 64, greedy(8), tenant="B")
    for _ in range(4):
        engine.step()
    free = engine.kv.gpu.num_free
    assert free < 23
    engine.take_events()
    engine.add_request("a1", [10] * 32 + [11] * 60, greedy(2), tenant="A")
    final = run_all(engine)
    assert final["a1"].output_token_ids == expected([10] * 32 + [11] * 60, 2)
    assert final["a1"].num_cached_tokens == 32
    preempted = [e for e in engine.take_events() if e.type == "Preempted"]
    assert [(e.request_id, e.reason, e.needed_blocks, e.free_blocks) for e in preempted] == \
        [("b1", "fairness", 23, free)]


def test_the_share_policy_waits_for_the_heavier_tenants_requests_to_end():
    engine, first, b_running = pool_held_by_b("share")
    assert first > 1 and len(b_running) < 2
    assert not engine.scheduler.counters.preemptions_by_reason


def test_fairness_never_preempts_a_more_important_request():
    engine, first, b_running = pool_held_by_b("vtc", a1_priority=1,
                                              scheduling_policy="priority")
    assert "fairness" not in engine.scheduler.counters.preemptions_by_reason
    assert first > 1


def test_a_lighter_tenant_holding_as_much_of_the_batch_preempts_nobody():
    """A is served less than B, but B holds one seat of two and A would hold two: taking
    B's would only turn the tables (B's request would then preempt A's back)."""
    engine = sim_engine(max_num_seqs=2, num_gpu_blocks=256, fairness="vtc")
    engine.add_request("a0", [10] * 8, greedy(30), tenant="A")
    engine.add_request("b0", [20] * 20, greedy(30), tenant="B")
    engine.step()
    engine.step()
    engine.add_request("a1", [11] * 8, greedy(30), tenant="A")  # no seat: b0 has it
    vtc = engine.scheduler.vtc
    assert vtc.served_of("A") < vtc.served_of("B")
    run_all(engine)
    assert not engine.scheduler.counters.preemptions_by_reason


def test_a_lighter_tenant_takes_a_seat_from_one_holding_more():
    """B holds three seats of four, A one: A's next request takes B's newest seat (two
    each; B's request would not take it back, two against two)."""
    engine = sim_engine(max_num_seqs=4, num_gpu_blocks=256, fairness="vtc")
    engine.add_request("a0", [10] * 8, greedy(30), tenant="A")
    for i in range(3):
        engine.add_request(f"b{i}", [20 + i] * 20, greedy(30), tenant="B")
    engine.step()
    engine.step()
    engine.add_request("a1", [11] * 8, greedy(30), tenant="A")  # no seat
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a0", "a1", "b0", "b1"}
    final = run_all(engine)
    assert engine.scheduler.counters.preemptions_by_reason == {"fairness": 1}
    assert final["b2"].output_token_ids == expected([22] * 20, 30)


def test_with_a_cache_quota_the_quota_decides_and_fairness_preempts_nobody():
    engine, first, _ = pool_held_by_b("vtc", tenant_cache_quota=0.9)
    assert "fairness" not in engine.scheduler.counters.preemptions_by_reason
    assert first > 1


def test_a_prefix_a_tenants_requests_share_counts_once_in_what_it_holds():
    """A's three running chats share a 40-token system prompt (10 blocks); B's two 64-token
    prompts hold more of the pool than A does. A's a3 (A served less) needs more blocks
    than are free: B's newest gives way. Counted per request, A's shared blocks would make
    A hold more than B, and nobody would (a3 would wait for B's requests to end)."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=52, num_cpu_blocks=0, fairness="vtc")
    system = [9] * 40
    for i in range(3):
        engine.add_request(f"a{i}", system + [i + 1], greedy(40), tenant="A")
    engine.add_request("b0", [50] * 64, greedy(30), tenant="B")
    engine.add_request("b1", [51] * 64, greedy(30), tenant="B")
    for _ in range(4):
        engine.step()
    kv, vtc = engine.kv, engine.scheduler.vtc
    assert vtc.served_of("A") < vtc.served_of("B")
    a_ids = ["a0", "a1", "a2"]
    distinct, per_request = kv.num_blocks_held_by(a_ids), sum(map(kv.num_blocks_held, a_ids))
    b_held = kv.num_blocks_held_by(["b0", "b1"])
    need = 6  # a3's 24 tokens past the shared prompt, in blocks of 4
    assert kv.gpu.num_free < need
    assert distinct + need < b_held <= per_request + need
    engine.take_events()
    engine.add_request("a3", system + [7] * 24, greedy(2), tenant="A")
    engine.step()
    assert "a3" in {r.request_id for r in engine.scheduler.running}
    preempted = [e for e in engine.take_events() if e.type == "Preempted"]
    assert [(e.request_id, e.reason, e.by) for e in preempted] == [("b1", "fairness", "a3")]
    final = run_all(engine)
    assert final["b1"].output_token_ids == expected([51] * 64, 30)


def stuck_behind_b(a_running: int = 0) -> object:
    """A was served a long prompt before (its counter above B's), B's b0 holds most of the
    26-block pool, and B's next request b1 (16 blocks) does not fit: VTC's next pick,
    stuck. a_running: tokens of an A request running beside b0 (A holding that much of
    the pool). Then A's a1 (8 tokens, 2 blocks) arrives."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=26, num_cpu_blocks=0,
                        fairness="vtc", enable_prefix_caching=False)
    engine.add_request("a0", [1] * 100, greedy(2), tenant="A")
    run_all(engine)
    engine.add_request("b0", [2] * 40, greedy(30), tenant="B")
    if a_running:
        engine.add_request("a2", [5] * a_running, greedy(30), tenant="A")
    engine.step()
    engine.step()
    engine.add_request("b1", [3] * 64, greedy(2), tenant="B")
    engine.add_request("a1", [4] * 8, greedy(2), tenant="A")
    vtc = engine.scheduler.vtc
    assert vtc.served_of("B") < vtc.served_of("A")  # b1 is VTC's pick
    assert 2 <= engine.kv.gpu.num_free < 16  # a1 fits, b1 does not
    return engine


def test_while_vtcs_pick_waits_for_blocks_a_tenant_holding_less_goes_on():
    engine = stuck_behind_b()
    engine.step()
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert "a1" in {r.request_id for r in engine.scheduler.running} and waiting == {"b1"}
    final = run_all(engine)
    assert final["b1"].output_token_ids == expected([3] * 64, 2)
    assert not engine.scheduler.counters.preemptions_by_reason


def test_a_tenant_holding_as_much_as_the_stuck_one_waits_with_it():
    """A's a2 holds more of the pool than B's b0: A's a1 may not take the blocks b1
    waits for (B's own ending requests make b1's room, and A's could keep taking it)."""
    engine = stuck_behind_b(a_running=44)
    kv = engine.kv
    assert kv.num_blocks_held("a2") >= kv.num_blocks_held("b0")
    engine.step()
    assert {r.request_id for r in engine.scheduler.waiting} == {"b1", "a1"}


def test_a_heavier_tenants_prompt_chunks_go_after_the_lighter_tenants_admission():
    """B's 400-token prompt is prefilled 64 tokens a step; A's 20-token prompt arrives (A
    served less): the next step computes all of it, and B's chunk no more than that."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=256, fairness="vtc")
    engine.add_request("b0", [2] * 400, greedy(4), tenant="B")
    engine.step()
    engine.add_request("a0", [3] * 20, greedy(4), tenant="A")
    out = engine.scheduler.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == \
        {"a0": 20, "b0": 20}
    assert [s.request.request_id for s in out.scheduled] == ["a0", "b0"]


def test_a_more_important_heavier_prompt_chunk_does_not_give_way():
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=256, fairness="vtc",
                        scheduling_policy="priority")
    engine.add_request("b0", [2] * 400, greedy(4), tenant="B", priority=0)
    engine.step()
    engine.add_request("a0", [3] * 20, greedy(4), tenant="A", priority=1)
    out = engine.scheduler.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"b0": 64}


def test_under_vtc_the_pool_running_out_preempts_the_tenant_holding_most():
    """B's two long requests and A's short one, admitted last, fill the pool; when a
    running request needs a block, B's newest gives way, not A's request (the last)."""
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=40, num_cpu_blocks=0, fairness="vtc")
    engine.add_request("b0", [50] * 60, greedy(40), tenant="B")
    engine.add_request("b1", [51] * 60, greedy(40), tenant="B")
    engine.step()
    engine.add_request("a0", [9] * 8, greedy(40), tenant="A")
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["b0", "b1", "a0"]
    engine.take_events()
    while not engine.scheduler.counters.num_preemptions:
        engine.step()
    preempted = [e for e in engine.take_events() if e.type == "Preempted"]
    assert [(e.request_id, e.reason) for e in preempted] == [("b1", "kv_full")]
    final = run_all(engine)
    assert final["b1"].output_token_ids == expected([51] * 60, 40)


def test_a_lighter_tenant_at_its_share_lets_the_heavier_tenants_request_in():
    """L (weight 50: served least) holds its share of the batch (2 of 4 seats); L's l2 is
    VTC's pick but over L's share, so H's h1, waiting beside it, takes the seat."""
    engine = sim_engine(max_num_seqs=4, max_batch_share=0.5, num_gpu_blocks=256,
                        fairness="vtc")
    engine.set_tenant("L", weight=50.0)
    engine.add_request("h0", [10] * 40, greedy(200), tenant="H")
    for _ in range(5):
        engine.step()
    engine.add_request("l0", [20] * 5, greedy(200), tenant="L")
    engine.add_request("l1", [21] * 5, greedy(200), tenant="L")
    for _ in range(3):
        engine.step()
    engine.add_request("l2", [22] * 5, greedy(200), tenant="L")
    engine.add_request("h1", [11] * 5, greedy(200), tenant="H")
    vtc = engine.scheduler.vtc
    assert vtc.served_of("L") < vtc.served_of("H")
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"h0", "l0", "l1", "h1"}


def new_tenant_each_step(engine, prompt: list[int], steps: int, first: int = 2) -> list[int]:
    """From step `first`, a tenant never seen before sends `prompt` each step (each one
    lifted under every counter: VTC's next pick); h0's computed tokens after each step."""
    h0, seen = engine.scheduler.requests["h0"], []
    for step in range(steps):
        if step >= first:
            engine.add_request(f"x{step}", prompt, greedy(1), tenant=f"T{step}")
        engine.step()
        engine.kv.check_invariants()
        seen.append(h0.num_computed_tokens)
    return seen


def test_a_heavier_prompt_progresses_beside_lighter_prompts_all_cached():
    """The new tenants' 9-token prompts are cached but their last token: one prompt token
    each. H's 600-token prompt still takes its floor of each step's 64 tokens."""
    engine = sim_engine(num_gpu_blocks=256, max_num_seqs=8, fairness="vtc")
    engine.add_request("w", [40] * 9, greedy(1), tenant="W")
    run_all(engine)
    engine.add_request("h0", [10] * 600, greedy(5), tenant="H")
    seen = new_tenant_each_step(engine, [40] * 9, 8)
    assert DEFERRED_FLOOR * 64 == 8  # (an eighth of the step's tokens, not the one)
    assert all(b - a >= 8 for a, b in zip(seen[2:], seen[3:])), seen


def test_a_deferred_prompt_of_its_tenants_oldest_request_grows_past_the_quota():
    """H's only request, larger than H's quota leaves it beside C's cached prompt, has its
    chunks deferred behind the new tenants' admissions: it still takes its blocks and ends."""
    engine = sim_engine(num_gpu_blocks=64, max_num_seqs=8, fairness="vtc",
                        tenant_cache_quota=0.25)
    engine.add_request("c0", [30] * 60, greedy(1), tenant="C")
    run_all(engine)
    engine.add_request("h0", [10] * 200, greedy(5), tenant="H")
    final = {}
    for step in range(12):
        if step >= 3:
            engine.add_request(f"x{step}", [40 + step] * 5, greedy(1), tenant=f"T{step}")
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.check_invariants()
    assert final["h0"].output_token_ids == expected([10] * 200, 5)
