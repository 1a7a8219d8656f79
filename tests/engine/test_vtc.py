"""Token-weighted fairness (EngineConfig.fairness = "vtc", engine/sched/fairness.py):
the tenant served the fewest weighted tokens is admitted first, priorities still win, a
tenant back from idle joins at the least counter, and outputs stay the reference's."""
import pytest

from engine.errors import InvalidRequestError
from engine.sched.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT
from tests.engine.sim import expected, greedy, sim_engine


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
    assert vtc.served["C"] == min(vtc.served["A"], vtc.served["B"]) > 0
    before = vtc.served["A"]
    engine.add_request("a2", [12] * 10, greedy(5), tenant="A")  # active: not lifted
    assert vtc.served["A"] == before


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1e9])
def test_a_bad_weight_is_refused(bad):
    engine = sim_engine(fairness="vtc")
    with pytest.raises(InvalidRequestError, match="weight"):
        engine.set_tenant("A", weight=bad)
