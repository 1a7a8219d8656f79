"""KV held by tenant (engine/observe/tenants.py): blocks held by pool, cached blocks and
block-seconds per tenant, the top tenants named and the rest added up, in the metrics."""
from engine import SamplingParams
from engine.kv.block_seconds import TenantKV
from engine.observe.tenants import kv_by_tenant
from engine.block_hash import hash_blocks, root_hash
from tests.engine.sim import greedy, run_all, sim_engine
from tests.engine.test_disk_tier import BLOCK, disk_engine, prompt_of
from tests.support.clock import Clock


def test_the_top_tenants_by_blocks_are_named_and_the_rest_added_up():
    meter = {"a": TenantKV(gpu=1, gpu_s=50.0), "b": TenantKV(gpu=4, cpu=2, gpu_s=8.0, cpu_s=1.0),
             "c": TenantKV(gpu_s=3.0), None: TenantKV(gpu=2), "idle": TenantKV()}
    out = kv_by_tenant(meter, {"a": 5, "d": 1}, top=2)
    # a: 1 + 5 cached, b: 6; a's block-seconds break the tie; nothing at all: left out
    assert [r["tenant"] for r in out["tenants"]] == ["a", "b"]
    assert out["tenants"][0] == {"tenant": "a", "gpu_blocks": 1, "cpu_blocks": 0,
                                 "cached_blocks": 5, "cpu_cached_blocks": 0,
                                 "disk_cached_blocks": 0,
                                 "block_seconds": {"gpu": 50.0, "cpu": 0.0}}
    # the rest: None (2 blocks), d (1 cached), c (block-seconds only)
    assert out["other"] == {"tenants": 3, "gpu_blocks": 2, "cpu_blocks": 0, "cached_blocks": 1,
                            "cpu_cached_blocks": 0, "disk_cached_blocks": 0,
                            "block_seconds": {"gpu": 3.0, "cpu": 0.0}}
    # the tiers' cached blocks count too: e, with 9 on disk, is first
    tiered = kv_by_tenant(meter, {"a": 5}, top=1, tiers={"cpu": {"e": 2}, "disk": {"e": 7}})
    assert tiered["tenants"][0]["tenant"] == "e"
    assert (tiered["tenants"][0]["cpu_cached_blocks"], tiered["tenants"][0]["disk_cached_blocks"]) == (2, 7)
    assert tiered["other"]["cpu_cached_blocks"] == 0 and tiered["other"]["tenants"] == 4
    assert kv_by_tenant(meter, {}, top=10)["other"] is None


def test_the_metrics_tell_each_tenants_blocks_and_block_seconds_as_it_held_them():
    engine = sim_engine(num_gpu_blocks=64)  # blocks of 4 tokens
    clock = engine.events.clock = Clock(100.0)
    engine.add_request("a", list(range(10, 42)), SamplingParams(max_tokens=20), tenant="A")
    engine.add_request("b", list(range(50, 58)), SamplingParams(max_tokens=2), tenant="B")
    engine.step()  # both admitted at 100 s
    clock.now = 110.0
    held_a, held_b = engine.kv.num_blocks_held("a"), engine.kv.num_blocks_held("b")
    by_tenant = {r["tenant"]: r for r in engine.metrics()["kv_by_tenant"]["tenants"]}
    assert list(by_tenant) == ["A", "B"] and held_a > held_b  # A holds more: first
    assert by_tenant["A"]["gpu_blocks"] == held_a and by_tenant["B"]["gpu_blocks"] == held_b
    assert by_tenant["A"]["block_seconds"] == {"gpu": held_a * 10.0, "cpu": 0.0}
    assert by_tenant["B"]["block_seconds"] == {"gpu": held_b * 10.0, "cpu": 0.0}
    engine.step()  # B's last token: it ends at 110 s; A grows
    held_a_now = engine.kv.num_blocks_held("a")
    clock.now = 130.0
    by_tenant = {r["tenant"]: r for r in engine.metrics()["kv_by_tenant"]["tenants"]}
    assert by_tenant["B"]["gpu_blocks"] == 0  # ended: its block-seconds stay
    assert by_tenant["B"]["block_seconds"]["gpu"] == held_b * 10.0
    assert by_tenant["A"]["block_seconds"]["gpu"] == held_a * 10.0 + held_a_now * 20.0
    run_all(engine)
    ended = {r["tenant"]: r for r in engine.metrics()["kv_by_tenant"]["tenants"]}
    assert ended["A"]["gpu_blocks"] == 0
    assert ended["A"]["block_seconds"] == engine.kv_story("a")["block_seconds"]
    # its full blocks stay cached, under its tenant (BlockPool.cached_by_tenant)
    assert ended["A"]["cached_blocks"] == engine.kv.gpu.cached_by_tenant()["A"] > 0


def test_the_cpu_tier_and_the_disk_count_each_tenants_blocks(tmp_path):
    """A's prompt, asked twice, goes down the tiers as B's prompts flood the GPU pool:
    each tier counts it as A's, and read back from disk it is A's again on the GPU."""
    engine = disk_engine(tmp_path)
    first = prompt_of(0)
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)

    def ask(rid, prompt, tenant):
        engine.add_request(rid, prompt, greedy(6), tenant=tenant)
        return run_all(engine)[rid]

    def rows():
        return {r["tenant"]: r for r in engine.metrics()["kv_by_tenant"]["tenants"]}

    ask("cold", first, "A")
    ask("hit", first, "A")  # asked for again: its blocks may go to disk
    ask("b1", prompt_of(1), "B")
    ask("b2", prompt_of(2), "B")
    cpu = engine.kv.tiers[0]
    on_cpu = sum(cpu.holds(x) for x in hashes)
    assert on_cpu > 0 and rows()["A"]["cpu_cached_blocks"] == on_cpu
    assert rows()["B"]["cpu_cached_blocks"] == sum(
        1 for b in engine.kv.cpu.cached.values() if b.tenant == "B") > 0
    for seed in range(3, 9):
        ask(f"b{seed}", prompt_of(seed), "B")
    disk = engine.kv.tiers[-1]
    disk.store.flush()
    on_disk = sum(disk.holds(x) for x in hashes)
    assert on_disk >= 7 and rows()["A"]["disk_cached_blocks"] == on_disk
    assert rows()["B"]["disk_cached_blocks"] == 0  # (asked for once: never written)
    engine.add_request("back", first, greedy(6), tenant="A")
    engine.step()  # read back from disk into the CPU tier, then copied into GPU blocks
    read_back = [b for b in map(engine.kv.cpu.get_cached, hashes) if b is not None]
    assert read_back and all(b.tenant == "A" for b in read_back)
    assert run_all(engine)["back"].num_cached_tokens == 28


def test_a_tenants_key_is_the_pages():
    """tenant32 (a cached block's tenant in the live state) is FNV-1a of the label, the
    same numbers static/kvops/tenant_kv.js tenantHash gives (tests/dashboard/js/
    tenant_kv.test.mjs pins them too): a tenant's cached and held blocks share a colour."""
    from engine.observe.tenants import tenant32
    assert [tenant32(t) for t in ("A", None, "others", "3f2a9c0d11e4b7a8", "é")] == \
        [3289118412, 1734124753, 598067698, 3679306680, 513665217]
    assert tenant32(None) == tenant32("staff")
