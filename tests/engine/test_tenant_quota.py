"""Tenants' quota on the GPU prefix cache (engine/kv/tenant_cache.py): a tenant under
its quota keeps its prefix through another tenant's flood, and without the quota it is
evicted; the counts stay the pool's blocks recounted (check_invariants)."""
import pytest

from engine.errors import InvalidRequestError
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
