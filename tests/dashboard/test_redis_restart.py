"""Redis restarts under open pages (docs/operations.md, "What happens when things fail"): a real stack
(uvicorn, a simulated engine worker) on a redis-server of its own, the engine page and a
job page open in headless Chromium, jobs running; Redis is killed and started again on
the same port. The channel layer's group memberships went with it, so the pages only
keep up if the consumers re-join and the engine page resyncs: a job submitted after the
restart must show up on the engine page, deltas must follow one another again, the job
page must see its job end, and once the engine is idle the page's block map must be the
engine's."""
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from engine.observe.snapshot import decode_array
from tests.support.stack import Stack
from tests.session_redis import free_port, start_redis

ENGINE = dict(simulate=1, vocab_size=32000, num_gpu_blocks=256, num_cpu_blocks=64,
              block_size=16, max_num_seqs=8, simulate_step_ms=20)
PAGE_COUNTERS = """() => ({seq: kvops.state() && kvops.state().seq, deltas: kvopsPerf.deltas,
    snapshots: kvopsPerf.snapshots, resyncs: kvopsPerf.resyncs,
    reconnects: kvopsPerf.reconnects(), conn: document.querySelector('#conn').textContent})"""


@pytest.fixture
def stack(tmp_path):
    port = free_port()
    redis_proc = start_redis(port, str(tmp_path))
    s = Stack(Path(tmp_path), env={"REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    s.redis_port, s.redis_proc = port, redis_proc
    try:
        s.start_web()
        s.start_engine("sim", **ENGINE)
        yield s
    finally:
        s.stop()
        s.redis_proc.kill()
        s.redis_proc.wait()


def restart_redis(stack: Stack, down_s: float) -> None:
    stack.redis_proc.kill()
    stack.redis_proc.wait()
    time.sleep(down_s)
    stack.redis_proc = start_redis(stack.redis_port, str(stack.workdir))


def submit(stack: Stack, prompt: str, max_tokens: int) -> int:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def on_page(page, request_id: str, timeout_s: float) -> None:
    page.wait_for_function("(rid) => kvops.state() && kvops.state().requestById(rid) !== null",
                           arg=request_id, timeout=timeout_s * 1000)


def open_engine_page(login, stack: Stack, user: str, password: str):
    page, errors = login(stack, user, password)
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1 && kvopsPerf.deltas >= 3")
    return page, errors


def assert_pages_follow(stack: Stack, pages, what: str) -> None:
    """A job submitted now shows up on every engine page, whose deltas then follow one
    another (each applied, no snapshot in between); each page resynced since `before`, or
    missed no delta at all."""
    job_id = submit(stack, f"submitted after {what}", max_tokens=300)  # ~6 s
    started = time.monotonic()
    request_id = stack.wait_running(job_id, 30)
    for page, before in pages.items():
        on_page(page, request_id, 20)
        # A stale snapshot (the engine's answer was late) shows the job too; the page is
        # back once it is live again.
        page.wait_for_function("document.querySelector('#conn').textContent === 'live'",
                               timeout=10_000)
        first = page.evaluate(PAGE_COUNTERS)
        page.wait_for_function(f"kvopsPerf.deltas >= {first['deltas'] + 10}", timeout=10_000)
        later = page.evaluate(PAGE_COUNTERS)
        assert later["snapshots"] == first["snapshots"], (first, later,
                                                          page.evaluate("kvopsPerf.log"))
        assert later["seq"] - first["seq"] == later["deltas"] - first["deltas"], (first, later)
        # It resynced, or it missed nothing at all: a consumer that re-joined its group
        # before the next delta went out lost none (no timing is assumed either way).
        missed_nothing = later["seq"] - before["seq"] == later["deltas"] - before["deltas"]
        assert later["snapshots"] > before["snapshots"] or missed_nothing, (before, later)
        assert later["conn"] == "live", later
        print(f"{what}: the page shows a new job {time.monotonic() - started:.1f} s after it "
              f"was submitted; before {before}, after {later}")
        pages[page] = later


def summaries_flow(overview) -> None:
    """The overview's card of the engine gets metrics again."""
    seen = overview.evaluate("kvopsSummaries.sim || 0")
    overview.wait_for_function(f"(kvopsSummaries.sim || 0) >= {seen + 3}", timeout=15_000)


def test_pages_resync_after_a_redis_restart(login, stack):
    # Two engine pages, the overview and a job page: consumers of one process share a
    # channel-layer receive, so a restart does not hit each of them the same way.
    pages, errors = zip(open_engine_page(login, stack, "admin", "admin-pass-123"),
                        open_engine_page(login, stack, "alice", "alice-pass-123"))
    errors = [e for page_errors in errors for e in page_errors]
    overview = pages[1].context.new_page()
    overview.on("pageerror", lambda e: errors.append(str(e)))
    overview.goto(f"{stack.url}/")
    summaries_flow(overview)
    job_id = submit(stack, "running through the restart", max_tokens=400)  # ~8 s
    request_id = stack.wait_running(job_id, 30)
    for page in pages:
        on_page(page, request_id, 10)
    job_page = pages[0].context.new_page()
    job_page.on("pageerror", lambda e: errors.append(str(e)))
    job_page.goto(f"{stack.url}/jobs/{job_id}/")
    job_page.wait_for_function("document.querySelector('#conn').textContent === 'live'")
    pages = {page: page.evaluate(PAGE_COUNTERS) for page in pages}

    restart_redis(stack, down_s=1.0)
    assert_pages_follow(stack, pages, "a Redis restart")
    summaries_flow(overview)

    # The job page, open through the restart, sees its job end (by websocket only).
    job_page.wait_for_function("document.querySelector('#status').textContent === 'finished'",
                               timeout=30_000)
    text = stack.api("GET", f"/api/jobs/{job_id}/").json()["output_text"]
    assert job_page.inner_text("#output") == text

    # Group memberships lost with no connection error at all (a failover to a replica
    # without them, a FLUSHALL, expiry): nothing tells the consumers.
    client = redis.Redis(port=stack.redis_port)
    groups = client.keys("asgi:group:*")
    assert groups
    client.delete(*groups)
    assert_pages_follow(stack, pages, "group memberships were lost")
    summaries_flow(overview)

    # Once the engine is idle, the pages' block maps are the engine's.
    stack.wait(lambda: engine_idle(stack), "the engine idle", 30)
    for page in pages:
        stack.wait(lambda: page_matches_engine(page, stack),  # noqa: B023 (called here)
                   "the page's block map equal to the engine's", 15)
    assert not errors, errors
    log = stack.log("web")
    assert "Traceback" not in log, log[log.index("Traceback") - 3000:][:8000]


def engine_idle(stack: Stack) -> bool:
    snap = stack.api("GET", "/api/engines/sim/").json()["snapshot"]
    return not [r for r in snap["requests"] if r["status"] in ("running", "waiting", "swapped")]


def page_matches_engine(page, stack: Stack) -> bool:
    snap = stack.api("GET", "/api/engines/sim/").json()["snapshot"]
    shown = page.evaluate("() => ({requests: kvops.state().requests.size, "
                          "state: Array.from(kvops.state().gpu.state), "
                          "ref_cnt: Array.from(kvops.state().gpu.ref_cnt)})")
    return (shown["requests"] == len(snap["requests"])
            and np.array_equal(shown["state"], decode_array(snap["gpu"]["state"]))
            and np.array_equal(shown["ref_cnt"], decode_array(snap["gpu"]["ref_cnt"])))
