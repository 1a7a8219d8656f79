"""A plain viewer's copy of an engine's KV by tenant (kvops/dashboard/visibility.py
seal_metrics): their own tenant's row, the rest added up without names or a count, and
whether their tenant is counted in the engine's `other` (outside its top tenants)."""
from engine.observe.tenants import kv_by_tenant
from engine.kv.block_seconds import TenantKV
from kvops.dashboard.visibility import seal_metrics


def metrics(top: int) -> dict:
    meter = {t: TenantKV(gpu=n) for t, n in (("big", 9), ("mid", 5), ("small", 1))}
    return {"kv_by_tenant": kv_by_tenant(meter, {}, top=top)}


def test_a_tenant_among_the_top_reads_its_own_row():
    sealed = seal_metrics(metrics(top=3), "mid")["kv_by_tenant"]
    assert [r["tenant"] for r in sealed["tenants"]] == ["mid"]
    assert sealed["other"]["gpu_blocks"] == 10 and sealed["other"]["tenants"] is None
    assert sealed["mine_in_other"] is False


def test_a_tenant_outside_the_top_is_told_it_is_counted_in_other():
    sealed = seal_metrics(metrics(top=2), "small")["kv_by_tenant"]
    assert sealed["tenants"] == [] and sealed["other"]["gpu_blocks"] == 15
    assert sealed["mine_in_other"] is True
    assert "small" not in repr(sealed) and "big" not in repr(sealed)


def test_a_tenant_holding_nothing_where_every_tenant_is_named_is_not_in_other():
    sealed = seal_metrics(metrics(top=3), "absent")["kv_by_tenant"]
    assert sealed["tenants"] == [] and sealed["mine_in_other"] is False
