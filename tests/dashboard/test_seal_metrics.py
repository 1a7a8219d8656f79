"""A plain viewer's copy of an engine's KV by tenant (kvops/dashboard/visibility.py
seal_metrics): their own tenant's row, the rest added up without names or a count, and
whether their tenant is counted in the engine's `other` (outside its top tenants); and
the per-block tenant of cached blocks, theirs or `others`."""
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


def test_a_plain_viewer_reads_every_other_tenants_cached_blocks_as_others():
    """The per-block tenant32 (a cached block's tenant, for the map's colouring): the
    viewer's own key kept, every other tenant's the key of `others`, none kept none."""
    import numpy as np

    from engine.observe.snapshot import decode_array, encode_array
    from engine.observe.tenants import tenant32
    from kvops.dashboard.visibility import OTHERS, seal_document

    mine, theirs = tenant32("mine"), tenant32("theirs")
    array = np.array([0, mine, theirs, tenant32("third")], dtype=np.uint32)
    snapshot = {"gpu": {"state": encode_array(np.zeros(4, np.uint8), True),
                        "tenant32": encode_array(array, True)}}
    sealed = decode_array(seal_document(snapshot, "mine")["gpu"]["tenant32"])
    assert sealed.dtype == np.uint32
    assert sealed.tolist() == [0, mine, tenant32(OTHERS), tenant32(OTHERS)]
    delta = {"gpu": {"ids": [0, 1, 1], "tenant32": [theirs, mine, 0]}}
    assert seal_document(delta, "mine")["gpu"]["tenant32"] == [tenant32(OTHERS), mine, 0]
    assert seal_document(delta, None)["gpu"]["tenant32"] == [tenant32(OTHERS)] * 2 + [0]
