"""Tenants' quota on the GPU prefix cache (engine/kv/tenant_cache.py): a tenant under
its quota keeps its prefix through another tenant's flood, and without the quota it is
evicted; the counts stay the pool's blocks recounted (check_invariants)."""
import pytest

from engine.block_hash import hash_block, root_hash
from engine.errors import InvalidRequestError
from engine.kv.block_pool import BlockPool
from engine.kv.events import EventLog
from tests.engine.sim import expected, greedy, run_all, sim_engine

A_PROMPT = [7] * 32 + [8]  # 8 full blocks of 4 tokens


def flood(engine, n: int = 12) -> None:
    """Tenant B: n unique prompts of 8 full blocks each, two running at a time."""
    for i in range(n):
        engine.add_request(f"b{i}", [100 + i] * 32 + [9], greedy(2), tenant="B")
    final = run_all(engine)
    assert all(final[f"b{i}"].output_token_ids == expected([100 + i] * 32 + [9], 2)
               for i in range(n))


def scenario(**config) -> tuple[object, int]:
    """A's prompt, then B's flood, then A's prompt again: the engine and the tokens
    A's second request found cached."""
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=2, num_cpu_blocks=0, **config)
    engine.add_request("a0", A_PROMPT, greedy(2), tenant="A")
    run_all(engine)
    assert engine.kv.gpu.cached_by_tenant()["A"] == 8
    flood(engine)
    engine.add_request("a1", A_PROMPT, greedy(2), tenant="A")
    final = run_all(engine)
    assert final["a1"].output_token_ids == expected(A_PROMPT, 2)
    return engine, final["a1"].num_cached_tokens


def test_a_quota_keeps_a_tenants_prefix_through_anothers_flood():
    engine, cached = scenario(tenant_cache_quota=0.5)
    assert cached == 32
    assert engine.kv.gpu.tenants.num_taken > 0
    assert engine.kv.gpu.cached_by_tenant()["A"] == 8


def test_without_a_quota_the_flood_evicts_the_prefix():
    engine, cached = scenario()
    assert cached == 0
    assert engine.kv.gpu.tenants.num_taken == 0


def test_a_tenants_own_quota_set_live():
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=2, num_cpu_blocks=0)
    engine.add_request("a0", A_PROMPT, greedy(2), tenant="A")
    run_all(engine)
    limits = engine.set_tenant("B", cache_quota=0.25)
    assert limits["cache_quota_blocks"] == 10 and limits["own_cache_quota"]
    flood(engine)
    assert engine.kv.gpu.cached_by_tenant()["A"] == 8
    assert engine.tenant_limits("A")["cache_quota"] == 1.0  # others keep everyone's
    cleared = engine.set_tenant("B", clear=("cache_quota",))
    assert cleared["cache_quota"] == 1.0 and not cleared["own_cache_quota"]


def test_running_blocks_are_never_taken_by_the_quota():
    """B alone, over a tiny quota: its running requests keep every block they hold and
    run to the reference's outputs (the quota only chooses among free cached blocks)."""
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=2, num_cpu_blocks=0,
                        tenant_cache_quota=0.05)
    flood(engine, 6)
    assert engine.scheduler.counters.num_preemptions == 0


def test_retention_sets_everyones_quota():
    engine = sim_engine(num_gpu_blocks=40)
    assert engine.set_retention(tenant_cache_quota=0.5)["tenant_cache_quota"] == 0.5
    assert engine.tenant_limits("anyone")["cache_quota_blocks"] == 20


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, "half", True, float("nan")])
def test_a_quota_out_of_range_is_refused(bad):
    engine = sim_engine(num_gpu_blocks=40)
    with pytest.raises(InvalidRequestError, match="cache_quota"):
        engine.set_tenant("B", cache_quota=bad)
    with pytest.raises(InvalidRequestError, match="tenant_cache_quota"):
        engine.set_retention(tenant_cache_quota=bad)
    assert engine.tenant_limits("B")["cache_quota"] == 1.0


def test_bad_tenant_arguments_are_refused():
    engine = sim_engine(num_gpu_blocks=40)
    with pytest.raises(InvalidRequestError, match="tenant"):
        engine.set_tenant("", cache_quota=0.5)
    with pytest.raises(InvalidRequestError, match="clear"):
        engine.set_tenant("B", clear=("everything",))
    with pytest.raises(InvalidRequestError, match="vtc"):
        engine.set_tenant("B", weight=2.0)  # fairness "share": there is no weight


def pool_with(quota: float):
    """Ten blocks; A caches 2 and B 4, all freed (B over a 0.3 quota: 3 blocks)."""
    pool = BlockPool(10, enable_caching=True, events=EventLog(100), tenant_cache_quota=quota)
    blocks = pool.take_new(6)
    for i, block in enumerate(blocks):
        pool.cache(block, hash_block(root_hash("m", None), (i,)), "A" if i < 2 else "B")
    pool.free(blocks)
    return pool, blocks[:2], blocks[2:]


def test_an_over_quota_tenants_admission_passes_over_the_others_cached_blocks():
    pool, a_blocks, b_blocks = pool_with(0.3)
    assert pool.cached_by_tenant() == {"A": 2, "B": 4}
    assert pool.room_for("B") == 8 and pool.room_for("A") == 10 and pool.room_for(None) == 10
    taken = pool.take_new(8, admitting="B")  # 4 never-cached, then B's own 4
    assert not set(taken) & set(a_blocks) and set(b_blocks) <= set(taken)
    assert pool.cached_by_tenant() == {"A": 2}


def test_a_running_requests_blocks_are_not_refused_for_the_quota():
    """Not admitting (a running request's next blocks): the quota's victims first (B's),
    then the policy's order, A's blocks included (the pool never refuses them; the
    scheduler decides who gives way, below)."""
    pool, a_blocks, _ = pool_with(0.3)
    taken = pool.take_new(10)
    assert set(a_blocks) <= set(taken) and pool.cached_by_tenant() == {}


def test_an_admission_takes_anothers_cached_blocks_only_up_to_its_own_quota():
    """B under its quota (5 blocks) with 2 cached: it may take 3 of A's 4 protected blocks,
    the room it has left, and no more."""
    pool = BlockPool(10, enable_caching=True, events=EventLog(100), tenant_cache_quota=0.5)
    blocks = pool.take_new(6)
    for i, block in enumerate(blocks):
        pool.cache(block, hash_block(root_hash("m", None), (i,)), "A" if i < 4 else "B")
    pool.free(blocks)
    assert pool.room_for("B") == 9 and pool.room_for("A") == 9  # (A: 1 left, B 2 kept)
    taken = pool.take_new(9, admitting="B")
    assert set(blocks[4:]) <= set(taken)  # B's own first
    assert pool.cached_by_tenant() == {"A": 1}


def growth(quota: float, output_len: int = 40, n: int = 2, **config):
    """A caches its prompt (8 blocks of 40); then n of B's requests run, each growing to
    19 blocks: together more than the 32 blocks A's prefix leaves."""
    config = {"num_cpu_blocks": 0, **config}
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=2, tenant_cache_quota=quota, **config)
    engine.add_request("a0", A_PROMPT, greedy(2), tenant="A")
    run_all(engine)
    for i in range(n):
        engine.add_request(f"b{i}", [100 + i] * 32 + [9], greedy(output_len), tenant="B")
    final = run_all(engine)
    for i in range(n):
        assert final[f"b{i}"].output_token_ids == expected([100 + i] * 32 + [9], output_len)
    return engine


def test_a_tenants_growth_past_its_quota_preempts_its_own_newest_request():
    """B's running requests outgrow the room its quota leaves it: its newest request gives
    way (reason cache_quota) instead of B taking A's cached prefix, and runs again after."""
    engine = growth(0.5)
    by_reason = engine.scheduler.counters.preemptions_by_reason
    assert set(by_reason) == {"cache_quota"} and by_reason["cache_quota"] >= 1
    preempted = [e for e in engine.take_events() if e.type == "Preempted"]
    assert {(e.request_id, e.reason, e.by) for e in preempted} == {("b1", "cache_quota", "b0")}
    told = engine.kv_story("b1")["preemptions"]  # (what b1's job page and story say)
    assert told and {(p["reason"], p["by"]) for p in told} == {("cache_quota", "b0")}
    assert engine.kv.gpu.cached_by_tenant()["A"] == 8
    engine.add_request("a1", A_PROMPT, greedy(2), tenant="A")
    assert run_all(engine)["a1"].num_cached_tokens == 32


def test_a_tenants_growth_past_its_quota_swaps_its_newest_out_and_back_within_it():
    """Preemption by swap: B's newest is swapped out for the quota (reason cache_quota)
    and swapped back in only as B's room under its quota allows, never into A's prefix."""
    engine = growth(0.5, num_cpu_blocks=40, preemption_mode="swap")
    counters = engine.scheduler.counters
    assert counters.num_swaps_out >= 1 and counters.num_swaps_in == counters.num_swaps_out
    swapped = [e for e in engine.take_events() if e.type == "SwappedOut"]
    assert swapped and {(e.request_id, e.reason) for e in swapped} == {("b1", "cache_quota")}
    assert engine.kv.gpu.cached_by_tenant()["A"] == 8
    engine.add_request("a1", A_PROMPT, greedy(2), tenant="A")
    assert run_all(engine)["a1"].num_cached_tokens == 32


def test_without_a_quota_the_growth_takes_the_prefix():
    engine = growth(1.0)
    assert "cache_quota" not in engine.scheduler.counters.preemptions_by_reason
    assert engine.kv.gpu.cached_by_tenant().get("A", 0) < 8


def test_a_tenants_only_running_request_still_takes_anothers_cached_blocks():
    """One B request larger than the room A's prefix leaves: it is B's oldest, so it takes
    A's blocks and ends (every tenant progresses), preempting nobody."""
    engine = growth(0.5, output_len=100, n=1)
    assert engine.scheduler.counters.num_preemptions == 0
    assert engine.kv.gpu.cached_by_tenant().get("A", 0) < 8


@pytest.mark.parametrize("quota", [0.5, 1.0])
def test_the_quota_holds_a_tenants_growth_with_several_layer_groups(quota):
    """A hybrid model (a sliding-window group beside a full one: each request's blocks
    are counted over both): B's growth gives way under the quota, and takes A's prefix
    without it."""
    engine = sim_engine(num_gpu_blocks=64, max_num_seqs=2, num_cpu_blocks=0,
                        tenant_cache_quota=quota, simulate_sliding_window=8,
                        simulate_hybrid=True)
    assert engine.kv.num_groups == 2
    engine.add_request("a0", A_PROMPT, greedy(2), tenant="A")
    run_all(engine)
    for i in range(2):
        engine.add_request(f"b{i}", [100 + i] * 32 + [9], greedy(60), tenant="B")
    final = run_all(engine)
    for i in range(2):
        assert final[f"b{i}"].output_token_ids == expected([100 + i] * 32 + [9], 60)
    engine.add_request("a1", A_PROMPT, greedy(2), tenant="A")
    cached = run_all(engine)["a1"].num_cached_tokens
    quota_preemptions = engine.scheduler.counters.preemptions_by_reason["cache_quota"]
    if quota < 1.0:
        assert quota_preemptions >= 1 and cached == 32
    else:
        assert quota_preemptions == 0 and cached == 0


def test_without_a_quota_an_admission_takes_in_the_policys_order():
    pool, a_blocks, _ = pool_with(1.0)
    assert pool.room_for("B") == 10
    taken = pool.take_new(6, admitting="B")  # 4 never-cached, then A's (freed first)
    assert set(a_blocks) <= set(taken)


def test_a_tenant_stopped_by_its_quota_waits_while_another_is_admitted():
    """B over its quota, its next request finds no room but A's cached blocks: it
    waits, and A's request queued behind it runs meanwhile (not head-of-line)."""
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=4, num_cpu_blocks=0,
                        tenant_cache_quota=0.25, max_num_batched_tokens=256)
    engine.add_request("a0", A_PROMPT, greedy(2), tenant="A")
    run_all(engine)
    for i in range(3):  # B: 3 x 9 blocks running (27 > its 10), 4 left besides A's 8
        engine.add_request(f"b{i}", [100 + i] * 32 + [9], greedy(30), tenant="B")
    engine.step()
    engine.add_request("b3", [103] * 32 + [9], greedy(2), tenant="B")
    engine.add_request("a1", A_PROMPT, greedy(2), tenant="A")
    engine.step()
    running = [r.request_id for r in engine.scheduler.running]
    assert "a1" in running and "b3" not in running, running
    assert engine.kv.gpu.cached_by_tenant()["A"] >= 8
    final = run_all(engine)
    assert final["a1"].num_cached_tokens == 32
    assert final["b3"].output_token_ids == expected([103] * 32 + [9], 2)


def test_a_tenants_first_request_runs_though_its_quota_leaves_it_too_little_room():
    """B's quota, a tenth of the pool (4 blocks), set live; A's cached prompts fill the
    pool, kept under A's own (none). B's request needs 9 blocks, more than B may take of
    A's: with nothing of B's running it takes them (as B's oldest running request would)
    and ends, on an engine otherwise idle, instead of waiting there for ever."""
    engine = sim_engine(num_gpu_blocks=40, max_num_seqs=4, num_cpu_blocks=0,
                        max_num_batched_tokens=256)
    engine.set_tenant("B", cache_quota=0.1)
    for i in range(4):
        engine.add_request(f"a{i}", [10 + i] * 36 + [8], greedy(2), tenant="A")
    run_all(engine)
    prompt = [100] * 32 + [9]
    assert engine.kv.gpu.room_for("B") < 9 <= engine.kv.gpu.num_free
    engine.add_request("b0", prompt, greedy(2), tenant="B")
    final = {}
    for _ in range(20):
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.check_invariants()
    assert final["b0"].output_token_ids == expected(prompt, 2)
