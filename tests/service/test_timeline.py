"""An engine's timeline (kvops/dashboard/timeline.py, GET /api/engines/<name>/timeline/ and
.../timeline/state/): the state it rebuilds at a moment is the snapshot the engine's
publisher stored at that moment, on the shared stack's simulated engine; and the writer
keeps windows whole, in sequence, within their age and bytes, on the session's Redis."""
import time

import numpy as np
import pytest

from engine.observe.feed import encode
from engine.observe.snapshot import decode_array
from kvops import live
from kvops.dashboard import timeline
from kvops.dashboard.timeline import TimelineLimits, TimelineWriter
from tests.dashboard.live_client import ARRAYS, LiveState


def rebuilt(stack, name: str, at: float) -> LiveState:
    answer = stack.api("GET", f"/api/engines/{name}/timeline/state/", params={"at": repr(at)})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["window"]["start"] <= at and all(d["ts"] <= at for d in body["deltas"])
    state = LiveState(body["keyframe"])
    for delta in body["deltas"]:
        state.apply(delta)  # raises SequenceGap unless they follow the keyframe in order
    return state


def assert_same(state: LiveState, snapshot: dict) -> None:
    assert state.seq == snapshot["seq"]
    for pool in ("gpu", "cpu"):
        for k in ARRAYS:
            stored = decode_array(snapshot[pool][k]).astype(np.int64)
            assert np.array_equal(state.arrays(pool)[k], stored), (snapshot["seq"], pool, k)
    assert state.request_list() == sorted(snapshot["requests"], key=lambda r: r["index"])
    assert state.eviction_order == snapshot["eviction_order"]
    assert state.metrics == snapshot["metrics"]


def test_the_state_at_a_moment_is_the_snapshot_of_that_moment(stack):
    """While jobs come and go, the snapshots GET /api/engines/sim/ gives (the publisher
    stores one a second) are recorded with their times; once the timeline has moved past
    two keyframes, each is rebuilt from the timeline at its time and must equal it."""
    jobs = [stack.api("POST", "/api/jobs/", json={"prompt": f"timeline {i} " * (4 + 3 * i),
                                                   "max_tokens": 400 + 300 * i, "engine": "sim"}).json()["id"]
            for i in range(3)]
    seen: dict[int, dict] = {}

    def recorded_enough() -> bool:
        snapshot = stack.api("GET", "/api/engines/sim/").json()["snapshot"]
        if snapshot and snapshot["requests"]:
            seen[snapshot["seq"]] = snapshot
        if len(seen) < 8:
            return False
        first = min(s["ts"] for s in seen.values())
        windows = stack.api("GET", "/api/engines/sim/timeline/").json()["windows"]
        return sum(1 for w in windows if w["start"] > first) >= 2

    stack.wait(recorded_enough, "snapshots over two keyframes", 60)
    busy = [s for s in seen.values() if any(r["block_table"] for r in s["requests"])]
    assert len(busy) >= 4  # moments with blocks held, not just an idle engine
    for snapshot in seen.values():
        assert_same(rebuilt(stack, "sim", snapshot["ts"]), snapshot)
    for job in jobs:
        stack.api("POST", f"/api/jobs/{job}/cancel/")


def test_a_window_fetched_whole_reaches_the_next_keyframe(stack):
    index = {}

    def two_windows() -> bool:
        index.update(stack.api("GET", "/api/engines/sim/timeline/").json())
        return len(index["windows"]) >= 2

    stack.wait(two_windows, "two timeline windows", 30)
    assert index["seconds"] == 300 and index["oldest"] == index["windows"][0]["start"]
    first, second = index["windows"][-2:]
    whole = stack.api("GET", "/api/engines/sim/timeline/state/",
                      params={"at": repr(first["start"]), "through": "window"}).json()
    assert whole["window"] == {"id": first["id"], "start": first["start"], "end": second["start"]}
    assert whole["deltas"], "a window of 5 s with deltas at least once a second"
    assert all(first["start"] < d["ts"] <= second["start"] for d in whole["deltas"])
    assert all("events" not in d for d in whole["deltas"])
    only_at = stack.api("GET", "/api/engines/sim/timeline/state/",
                        params={"at": repr(first["start"])}).json()
    assert only_at["deltas"] == [] and only_at["keyframe"]["ts"] == first["start"]


@pytest.mark.parametrize("params, field", [
    ({}, "at"), ({"at": "yesterday"}, "ISO 8601"), ({"at": "nan"}, "finite"),
    ({"at": "inf"}, "finite"), ({"at": "1e999"}, "finite"), ({"at": "1", "through": "all"}, "through"),
    ({"at": "2026-13-45T99:00:00"}, "ISO 8601"), ({"at": "12\x00"}, "ISO 8601"),
])
def test_bad_moments_are_400_with_a_message(stack, params, field):
    answer = stack.api("GET", "/api/engines/sim/timeline/state/", params=params)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]


def test_moments_the_timeline_does_not_hold_and_unknown_engines_are_404(stack):
    long_ago = stack.api("GET", "/api/engines/sim/timeline/state/",
                         params={"at": "2001-01-01T00:00:00Z"})
    assert long_ago.status_code == 404 and "holds" in long_ago.json()["error"]["message"]
    assert stack.api("GET", "/api/engines/sim/timeline/state/",
                     params={"at": "-1e300"}).status_code == 404
    assert stack.api("GET", "/api/engines/nope/timeline/state/",
                     params={"at": "1"}).status_code == 404
    assert stack.api("GET", "/api/engines/nope/timeline/").status_code == 404
    assert stack.api("GET", "/api/engines/sim/timeline/", user=None).status_code == 401


# --- the writer, on the session's Redis -------------------------------------------------------
def keyframe(epoch: str, seq: int, ts: float) -> dict:
    return {"type": "snapshot", "engine": "w", "epoch": epoch, "seq": seq, "ts": ts, "pad": "x" * 50}


def delta_blob(epoch: str, seq: int, ts: float, size: int = 0) -> bytes:
    return encode({"type": "delta", "epoch": epoch, "seq": seq, "ts": ts,
                   "pad": np.random.default_rng(seq).bytes(size).hex()})


@pytest.fixture()
def writer_name():
    name = f"tl-{time.monotonic_ns()}"
    yield name
    client = live.redis_client()
    for key in client.scan_iter(f"kvops:engine:{name}:timeline*"):
        client.delete(key)


def window_seqs(name: str, at: float) -> list[int]:
    answer = timeline.window_at(name, at, through_window=True)
    return [answer["keyframe"]["seq"]] + [d["seq"] for d in answer["deltas"]]


def test_a_delta_the_keyframe_already_had_goes_to_the_window_before(writer_name):
    w = TimelineWriter(writer_name, TimelineLimits(seconds=60, max_bytes=10**7, keyframe_s=1000))
    w.add_delta("e", 1, 100.0, delta_blob("e", 1, 100.0))  # before any keyframe: nowhere
    w.add_keyframe(keyframe("e", 1, 100.0))
    w.add_delta("e", 2, 100.1, delta_blob("e", 2, 100.1))
    w.add_keyframe(keyframe("e", 4, 100.4))  # taken while 3 and 4 waited to be sent
    for seq in (3, 4):
        w.add_delta("e", seq, 100.0 + seq / 10, delta_blob("e", seq, 100.0 + seq / 10))
    assert timeline.windows(writer_name)[1] == 100.4  # the newest moment stays the keyframe's
    w.add_delta("e", 5, 100.5, delta_blob("e", 5, 100.5))
    assert timeline.windows(writer_name)[1] == 100.5
    assert window_seqs(writer_name, 100.2) == [1, 2, 3, 4]
    assert window_seqs(writer_name, 100.5) == [4, 5]
    assert [d["seq"] for d in timeline.window_at(writer_name, 100.35, False)["deltas"]] == [2, 3]
    assert timeline.window_at(writer_name, 99.9, False) is None


def test_a_lost_delta_asks_for_a_keyframe_at_once(writer_name):
    w = TimelineWriter(writer_name, TimelineLimits(seconds=60, max_bytes=10**7, keyframe_s=1000))
    w.add_keyframe(keyframe("e", 1, 100.0))
    w.add_delta("e", 2, 100.1, delta_blob("e", 2, 100.1))
    assert not w.keyframe_due()
    w.add_delta("e", 4, 100.3, delta_blob("e", 4, 100.3))  # 3 never came
    assert w.keyframe_due()
    w.add_keyframe(keyframe("other", 1, 100.4))  # a new publisher run
    w.add_delta("e", 5, 100.5, delta_blob("e", 5, 100.5))  # of the old run: not in the new window
    assert window_seqs(writer_name, 100.6) == [1]


def test_windows_go_whole_past_the_horizon_and_over_the_bytes(writer_name):
    w = TimelineWriter(writer_name, TimelineLimits(seconds=10, max_bytes=10**7, keyframe_s=1000))
    for k in range(6):  # a keyframe every 4 s, a delta a second
        start = 1000.0 + 4 * k
        w.add_keyframe(keyframe("e", 10 * k + 1, start))
        for s in range(1, 4):
            w.add_delta("e", 10 * k + 1 + s, start + s, delta_blob("e", 10 * k + 1 + s, start + s))
    starts = lambda: [win["start"] for win in timeline.windows(writer_name)[0]]  # noqa: E731
    # at the last keyframe (1020) the horizon was 1010: the window of 1008 holds it
    assert starts() == [1008.0, 1012.0, 1016.0, 1020.0]
    w.trim(1023.0)  # now 1013: the window of 1012 holds it, the one before goes
    assert starts() == [1012.0, 1016.0, 1020.0]
    assert timeline.window_at(writer_name, 1011.0, False) is None
    assert window_seqs(writer_name, 1012.5) == [31, 32, 33, 34]

    sizes = {win["id"]: win["bytes"] for win in timeline.windows(writer_name)[0]}
    w.limits = TimelineLimits(seconds=10, max_bytes=sum(sizes.values()) - 1, keyframe_s=1000)
    w.trim(1023.0)
    left = timeline.windows(writer_name)[0]
    assert [win["start"] for win in left] == [1016.0, 1020.0]
    stored = sum(len(b) for win in left for b in live.redis_client().lrange(
        f"kvops:engine:{writer_name}:timeline:{win['id']}", 0, -1))
    assert stored == sum(win["bytes"] for win in left)  # what the index counts is what is kept
    w.add_delta("e", 54, 1023.5, delta_blob("e", 54, 1023.5, size=4000))
    assert starts() == [1020.0]  # over the bytes again: all but the newest window went
