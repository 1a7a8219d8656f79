"""KV block-seconds (engine/kv/block_seconds.py): per request, blocks held x seconds on
each pool, moved only when the held count changes, and told in the request's KV story."""
import pytest

from engine import SamplingParams
from engine.kv.block_seconds import BlockSeconds
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.events import EventLog
from tests.engine.sim import run_all, sim_engine
from tests.engine.test_scheduler_kv import request
from tests.support.clock import Clock


def test_the_accumulator_adds_held_blocks_times_the_seconds_between_changes():
    clock = Clock(10.0)
    meter = BlockSeconds(clock)
    meter.change("r", gpu=3)
    clock.now = 12.0  # 3 GPU blocks for 2 s
    meter.change("r", gpu=1)
    clock.now = 13.0  # 4 for 1 s
    meter.change("r", gpu=-4, cpu=4)  # swapped out
    clock.now = 15.5  # 4 CPU blocks for 2.5 s
    assert meter.spent("r") == {"gpu": 10.0, "cpu": 10.0}
    meter.change("r", gpu=4, cpu=-4)
    clock.now = 16.0
    assert meter.end("r") == {"gpu": 12.0, "cpu": 10.0}
    assert len(meter) == 0 and meter.spent("r") == {"gpu": 0.0, "cpu": 0.0}
    with pytest.raises(RuntimeError, match="negative"):
        meter.change("q", gpu=-1)


def test_the_kv_core_tells_the_meter_as_tables_grow_swap_and_free():
    clock = Clock(100.0)
    kv = KVCacheCoordinator(4, 16, 8, True, EventLog(1000, clock=clock))
    a, b = request("a", list(range(10, 26))), request("b", list(range(40, 48)))
    kv.allocate_slots(a, 16)  # 4 blocks
    kv.allocate_slots(b, 8)  # 2 blocks
    clock.now = 101.0
    kv.free(b)
    assert kv.end("b") == {"gpu": 2.0, "cpu": 0.0}
    clock.now = 102.0
    kv.swap_out(a)
    clock.now = 105.0
    kv.free(a)
    assert kv.end("a") == {"gpu": 8.0, "cpu": 12.0}
    assert len(kv.block_seconds) == 0


def test_the_story_tells_each_requests_block_seconds_as_it_held_blocks():
    engine = sim_engine(num_gpu_blocks=32)
    clock = engine.events.clock = Clock(100.0)
    # a: 13 prompt tokens and 3 more written, 4 blocks all along; b: 5 and 1, 2 blocks
    engine.add_request("a", list(range(10, 23)), SamplingParams(max_tokens=4))
    engine.add_request("b", list(range(40, 45)), SamplingParams(max_tokens=2))
    engine.step()  # both admitted, their blocks taken at 100 s
    clock.now = 101.0
    engine.step()  # b's last token: it ends at 101 s
    assert engine.kv_story("b")["finish_reason"] == "length"
    assert engine.kv_story("a")["block_seconds"] == {"gpu": 4.0, "cpu": 0.0}  # live: so far
    clock.now = 102.0
    run_all(engine)  # a ends at 102 s
    assert engine.kv_story("a")["block_seconds"] == {"gpu": 8.0, "cpu": 0.0}
    assert engine.kv_story("b")["block_seconds"] == {"gpu": 2.0, "cpu": 0.0}
    assert len(engine.kv.block_seconds) == 0  # ended requests are forgotten


def test_a_tenants_block_seconds_keep_its_ended_requests_and_add_its_live_ones():
    clock = Clock(0.0)
    meter = BlockSeconds(clock)
    meter.change("a1", gpu=2, tenant="A")
    meter.change("b1", gpu=1, tenant="B")
    meter.change("s", gpu=1)  # no tenant (staff's)
    clock.now = 3.0
    meter.end("a1")  # A: 2 blocks for 3 s, ended
    meter.change("a2", gpu=4, tenant="A")
    meter.change("b1", gpu=-1, cpu=1)  # B's swapped out
    clock.now = 5.0
    by_tenant = meter.by_tenant()
    assert (by_tenant["A"].gpu, by_tenant["A"].gpu_s) == (4, 6.0 + 8.0)  # ended + live
    assert (by_tenant["B"].cpu, by_tenant["B"].gpu_s, by_tenant["B"].cpu_s) == (1, 3.0, 2.0)
    assert (by_tenant[None].gpu, by_tenant[None].gpu_s) == (1, 5.0)
    meter.end("a2")
    meter.end("b1")
    clock.now = 9.0  # ended requests' totals stay; they hold nothing more
    by_tenant = meter.by_tenant()
    assert (by_tenant["A"].gpu, by_tenant["A"].gpu_s) == (0, 14.0)
    assert (by_tenant["B"].cpu, by_tenant["B"].cpu_s) == (0, 2.0)
