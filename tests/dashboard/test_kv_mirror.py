"""The mirror the publisher keeps equals engine.snapshot(), and its deltas rebuild it."""
import numpy as np
import pytest

from engine import SamplingParams
from engine.observe.snapshot import decode_array
from engine.observe.tenants import tenant32
from engine.observe.view import EVENT_MAX_BLOCKS, Capturer, KVMirror, event_record
from tests.dashboard.churn import Churn, churn_engine
from tests.dashboard.live_client import ARRAYS, LiveState


def same_state(snapshot: dict, engine_snapshot: dict) -> None:
    for pool in ("gpu", "cpu"):
        for k in ARRAYS:
            ours, theirs = decode_array(snapshot[pool][k]), decode_array(engine_snapshot[pool][k])
            assert ours.dtype == theirs.dtype, (pool, k)
            assert np.array_equal(ours, theirs), (pool, k, np.flatnonzero(ours != theirs)[:10])
    assert snapshot["requests"] == engine_snapshot["requests"]
    assert snapshot["eviction_order"] == engine_snapshot["eviction_order"]
    assert snapshot["block_states"] == engine_snapshot["block_states"]


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["", "cpu-tier"])
@pytest.mark.parametrize("full_scan_s", [float("inf"), 0.0], ids=["events", "full-scans"])
def test_mirror_snapshot_equals_engine_snapshot_through_churn(full_scan_s, cpu_tier):
    engine = churn_engine(cpu_prefix_cache=True, num_gpu_blocks=40) if cpu_tier else churn_engine()
    churn, capturer = Churn(engine, seed=1), Capturer(full_scan_s=full_scan_s)
    mirror = KVMirror("t", "epoch", engine.describe_config())
    tenants = set()  # cached blocks' tenants the mirror told
    for i in range(400):
        churn()
        if i % 3 == 0:
            mirror.apply(capturer.capture(engine))
            same_state(mirror.snapshot(), engine.snapshot(compact=True))
            tenants.update(np.unique(mirror.gpu.tenant32).tolist())
    # the walk went through everything the dashboard draws
    assert {"add", "preempt", "swap_out", "swap_in", "pin", "unpin", "evict", "reset"} <= churn.seen
    assert {tenant32("A"), tenant32("B")} <= tenants
    assert mirror.gpu.drift == 0 and mirror.cpu.drift == 0
    if cpu_tier:  # the CPU pool held cached blocks, and prefixes came back from it
        assert engine.metrics()["cpu_prefix_cache_hits"] > 0


def test_an_engine_without_events_is_scanned_every_time():
    engine = churn_engine(max_pending_events=0)
    churn, capturer = Churn(engine, seed=5), Capturer(full_scan_s=float("inf"))
    mirror = KVMirror("t", "epoch", engine.describe_config())
    for i in range(150):
        churn()
        if i % 4 == 0:
            mirror.apply(capturer.capture(engine))
            same_state(mirror.snapshot(), engine.snapshot(compact=True))
    assert mirror.gpu.drift == 0


def test_a_full_scan_corrects_a_missed_event(caplog):
    engine = churn_engine()
    churn, capturer = Churn(engine, seed=4), Capturer(full_scan_s=float("inf"))
    mirror = KVMirror("t", "epoch", engine.describe_config())
    mirror.apply(capturer.capture(engine))
    for _ in range(40):
        churn()
    engine.take_events()  # someone else took them: the mirror misses BlockStored events
    mirror.apply(capturer.capture(engine))
    assert not np.array_equal(decode_array(mirror.snapshot()["gpu"]["hash32"]),
                              decode_array(engine.snapshot(compact=True)["gpu"]["hash32"]))
    capturer.full_scan_s = 0.0
    mirror.apply(capturer.capture(engine))
    same_state(mirror.snapshot(), engine.snapshot(compact=True))
    assert mirror.gpu.drift == 1 and "an event was missed" in caplog.text


def test_deltas_applied_to_a_snapshot_rebuild_the_state():
    engine = churn_engine(num_gpu_blocks=64, block_size=8)
    churn, capturer = Churn(engine, seed=2), Capturer()
    mirror = KVMirror("t", "epoch", engine.describe_config())
    for _ in range(30):
        churn()
    mirror.apply(capturer.capture(engine))
    client = LiveState(mirror.snapshot())
    for i in range(300):
        churn()
        if i % 2 == 0 or i == 299:
            client.apply(mirror.apply(capturer.capture(engine)))
    expected = LiveState(engine.snapshot(compact=True) | {"seq": client.seq, "epoch": "epoch"})
    for pool in ("gpu", "cpu"):
        for k in ARRAYS:
            assert np.array_equal(client.arrays(pool)[k], expected.arrays(pool)[k]), (pool, k)
    assert client.request_list() == expected.request_list()
    assert client.eviction_order == expected.eviction_order


def test_a_delta_lists_only_what_changed():
    engine = churn_engine()
    capturer = Capturer()
    mirror = KVMirror("t", "epoch", engine.describe_config())
    mirror.apply(capturer.capture(engine))
    quiet = mirror.apply(capturer.capture(engine))
    assert set(quiet) == {"type", "engine", "epoch", "seq", "ts", "step", "metrics"}
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=30))
    engine.step()
    delta = mirror.apply(capturer.capture(engine))
    assert [r["request_id"] for r in delta["requests"]["upsert"]] == ["a"]
    assert delta["tables"]["gpu"]["set"] == [[1, 0, 1, 2]]  # 10 tokens + room: 3 blocks of 4
    assert delta["gpu"]["ids"] == [0, 1, 1]  # gap-encoded 0, 1, 2
    for _ in range(2):
        engine.step()
    delta = mirror.apply(capturer.capture(engine))
    assert "upsert" not in delta["requests"]
    assert delta["requests"]["progress"] == {"index": [1], "computed": [2], "output": [2]}


def test_event_records_cut_long_block_lists():
    engine = churn_engine(block_size=1, num_gpu_blocks=128, max_num_batched_tokens=128)
    engine.add_request("long", list(range(80)), SamplingParams(max_tokens=1))
    engine.step()
    stored = [e for e in engine.take_events() if e.type == "BlockStored"]
    record = event_record(stored[0])
    assert record["num_blocks"] == len(stored[0].block_ids) > EVENT_MAX_BLOCKS
    assert len(record["block_ids"]) == len(record["block_hashes"]) == EVENT_MAX_BLOCKS


def test_a_forks_copy_on_write_is_mirrored():
    """Samples of a fork share the parent's partly filled last block until each writes
    into it: the copy replaces the table's last entry, which the mirror must see."""
    engine = churn_engine(max_num_batched_tokens=64)
    capturer, mirror = Capturer(), KVMirror("t", "epoch", engine.describe_config())
    engine.add_request("f", list(range(1, 7)), SamplingParams(max_tokens=6, n=3))
    copied = 0
    while engine.has_unfinished_requests():
        engine.step()
        capture = capturer.capture(engine)
        copied += sum(e.type == "CopiedOnWrite" for e in capture.events)
        mirror.apply(capture)
        same_state(mirror.snapshot(), engine.snapshot(compact=True))
    assert copied


def test_a_feed_whose_thread_is_behind_keeps_every_event_of_the_captures_it_merges():
    """The loop thread captures while the feed thread has not taken the last capture
    yet (a busy machine): the newest state goes on, carrying both captures' events (a
    capture is frozen: the merge is a new one, not an assignment that killed the core)."""
    from engine.observe.feed import KVFeed
    engine = churn_engine()
    feed = KVFeed("behind", emit=lambda item: None, interval_s=0.0)
    feed._thread = object()  # (its thread never takes a capture: it is behind)
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    feed(engine)
    first = feed._pending
    engine.add_request("b", list(range(50, 90)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    feed(engine)
    merged = feed._pending
    assert merged is not first and merged.version > first.version
    assert merged.events[:len(first.events)] == first.events
    assert len(merged.events) > len(first.events)
