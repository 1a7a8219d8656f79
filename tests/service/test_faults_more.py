"""More faults, each ending with every block given back on every engine that is up (no
used or pinned block once idle, as benchmarks/loadtest.py checks): a disk tier write
torn by SIGKILL, a full disk under the disk tier, the ops worker killed mid what-if, the
web process killed with streams open, PostgreSQL restarted under running jobs, and
Redis and PostgreSQL away together. What kvops promises in each case is in
docs/operations.md ("What happens when things fail"). The faults are injected by
tests/support/faults (a stack started with faults=True)."""
from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from engine.observe.snapshot import decode_array
from tests.support.stack import Stack

SIM = dict(simulate=1, num_gpu_blocks=16, block_size=16, max_num_seqs=4, simulate_step_ms=5)


def prompt(i: int) -> str:
    """Five full blocks of 16 bytes (the simulated engines count bytes as tokens), and
    a few more: no two prompts share a block."""
    return f"prompt {i:03d} " + "".join(chr(97 + (i * 7 + k) % 26) for k in range(80))


def run(stack: Stack, engine: str, prompts: list[str], max_tokens: int = 8) -> list[dict]:
    ids = []
    for text in prompts:
        r = stack.api("POST", "/api/jobs/", json={"prompt": text, "max_tokens": max_tokens,
                                                  "engine": engine})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return [stack.wait_job(i, timeout_s=60) for i in ids]


def texts(jobs: list[dict]) -> list[str]:
    assert all(j["status"] == "finished" for j in jobs), [(j["id"], j["status"], j["error"])
                                                           for j in jobs]
    return [j["output_text"] for j in jobs]


def metrics(stack: Stack, engine: str) -> dict:
    return stack.api("GET", f"/api/engines/{engine}/").json()["engine"]["metrics"]


def held_blocks(stack: Stack, engine: str) -> tuple[int, int, int]:
    """From the engine's stored snapshot: its used and pinned GPU blocks and its live
    requests."""
    snap = stack.api("GET", f"/api/engines/{engine}/").json()["snapshot"]
    states = decode_array(snap["gpu"]["state"])
    used = int(np.sum(states == snap["block_states"].index("used")))
    pinned = int(np.sum(states == snap["block_states"].index("pinned")))
    live = sum(r["status"] in ("waiting", "running", "swapped") for r in snap["requests"])
    return used, pinned, live


def assert_no_leak(stack: Stack, *engines: str) -> None:
    """Once idle, no block is held on any of these engines."""
    for engine in engines:
        stack.wait(lambda engine=engine: held_blocks(stack, engine) == (0, 0, 0),
                   f"engine {engine} idle with no used or pinned block", 30)


# --- the disk tier --------------------------------------------------------------------
def disk_config(folder: Path) -> dict:
    """The disk tier straight below the GPU pool (no CPU tier), every block the pool lets
    go written (min hits 0): sixteen blocks, so each job's blocks go to disk as the
    next jobs take the pool."""
    return dict(SIM, disk_cache_dir=str(folder), disk_cache_min_hits=0)


@pytest.fixture(scope="module")
def disk_stack(tmp_path_factory):
    """Engines `torn` and `full` with disk tiers of their own, `fresh` with none (the
    reference: the same prompts' outputs on an engine that never saw a disk)."""
    workdir = Path(tmp_path_factory.mktemp("disk-faults"))
    s = Stack(workdir, faults=True)
    try:
        s.start_web()
        s.start_engine("torn", **disk_config(workdir / "disk-torn"))
        s.start_engine("full", **disk_config(workdir / "disk-full"))
        s.start_engine("fresh", **SIM)
        yield s
    finally:
        s.stop()


def tmp_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.tmp"))


def test_a_disk_write_torn_by_sigkill_is_a_miss_after_the_restart(disk_stack):
    """The engine is SIGKILLed while its disk tier writes a block (the write stopped half
    way: tests/support/faults). Started again on the same folder, it drops the torn
    file, serves the blocks written whole before the kill from disk, and every prompt,
    the torn block's among them, gives what an engine without a disk gives. (Fails if
    the start-up scan kept the temporary file, or if write_new wrote in place: the torn
    block is then a file under its own name, a checksum failure at the restart.)"""
    s, folder = disk_stack, disk_stack.workdir / "disk-torn"
    prompts = [prompt(i) for i in range(12)]
    first = texts(run(s, "torn", prompts[:6]))
    s.wait(lambda: metrics(s, "torn")["disk_cache_stored_blocks"] >= 5,
           "blocks written to disk", 30)
    (s.workdir / "tear-torn").touch()  # the next write stops half way and hangs
    first += texts(run(s, "torn", prompts[6:]))  # (serving goes on meanwhile)
    torn = s.workdir / "torn-torn"
    s.wait(torn.exists, "a disk write torn", 30)
    assert tmp_files(folder), "the torn write left no temporary file"
    s.kill("engine-torn", signal.SIGKILL)

    s.start_engine("torn", **disk_config(folder))
    assert tmp_files(folder) == []  # the torn write is gone
    assert not list(folder.rglob(torn.read_text().strip()))  # never under the block's name
    again = texts(run(s, "torn", prompts))
    reference = texts(run(s, "fresh", prompts))
    assert again == reference == first
    after = metrics(s, "torn")
    assert after["disk_prefix_cache_hits"] > 0  # the blocks written whole came back
    assert after["disk_cache_checksum_failures"] == 0
    assert_no_leak(s, "torn", "fresh")


def test_a_full_disk_stops_the_tier_storing_says_so_and_serving_goes_on(disk_stack):
    """Every disk write fails with ENOSPC (tests/support/faults) while the disk is full:
    the jobs finish with the outputs of an engine without a disk, the tier stores no new
    block and says so (its metrics' write error, which the engine page's tier health
    shows, a counter in /metrics, one log line), and writes again once there is room.
    (Fails if a failed write is counted as stored, logged per block, or leaves its
    temporary file.)"""
    s, folder = disk_stack, disk_stack.workdir / "disk-full"
    prompts = [prompt(100 + i) for i in range(12)]
    texts(run(s, "full", prompts[:4]))
    s.wait(lambda: metrics(s, "full")["disk_cache_stored_blocks"] >= 1, "a block on disk", 30)
    full = s.workdir / "disk-full-full"
    full.touch()
    done = texts(run(s, "full", prompts[4:8]))
    s.wait(lambda: metrics(s, "full")["disk_cache_write_failures"] >= 1, "a failed write", 30)
    # (a write under way when the disk filled has ended by now: one writer, in order)
    before = metrics(s, "full")
    done += texts(run(s, "full", prompts[8:]))
    assert done == texts(run(s, "fresh", prompts[4:]))
    s.wait(lambda: metrics(s, "full")["disk_cache_write_failures"] >=
           before["disk_cache_write_failures"] + 4, "more failed writes", 30)
    m = metrics(s, "full")
    assert m["disk_cache_write_error"] == "No space left on device"
    assert m["disk_cache_stored_blocks"] == before["disk_cache_stored_blocks"]  # none more
    assert tmp_files(folder) == []
    scraped = s.api("GET", "/metrics").text
    assert any(line.startswith('kvops:disk_cache_write_failures_total{engine="full"}')
               and float(line.split()[-1]) >= 4 for line in scraped.splitlines()), scraped
    said = s.log("engine-full").count("disk tier: cannot write blocks under")
    assert said == 1, s.log("engine-full")[-3000:]

    full.unlink()  # room again: writing goes on
    texts(run(s, "full", [prompt(200 + i) for i in range(4)]))
    s.wait(lambda: metrics(s, "full")["disk_cache_stored_blocks"] >
           before["disk_cache_stored_blocks"],
           "blocks written again", 30)
    assert metrics(s, "full")["disk_cache_write_error"] is None
    assert "disk tier: writing blocks again" in s.log("engine-full")
    assert_no_leak(s, "full", "fresh")


# --- the ops worker -------------------------------------------------------------------
def test_the_ops_worker_killed_mid_what_if_fails_the_run_and_a_new_one_finishes(tmp_path):
    """SIGKILL the ops worker while it replays (held mid-replay: tests/support/faults):
    the run's beat stops, and it reads as failed with the reason within
    KVOPS_ENGINE_DEAD_AFTER_S, not 'running' until the time limit; a run started once
    an ops worker runs again finishes. (Fails with the rule of the time limit alone: the
    run stays running for its 12 minutes.)"""
    s = Stack(tmp_path, env={"KVOPS_ENGINE_DEAD_AFTER_S": "3"}, faults=True)
    try:
        s.start_web()
        s.start_engine("wi", **SIM)
        texts(run(s, "wi", [prompt(300 + i) for i in range(6)]))
        (tmp_path / "stall-what-if").touch()
        s.start_ops_worker(KVOPS_TEST_STALL_WHAT_IF="1")
        r = s.api("POST", "/api/engines/wi/what-if/", json={"minutes": 10,
                                                             "num_gpu_blocks": 32})
        assert r.status_code == 202, r.text
        lost = r.json()["id"]
        s.wait(lambda: (tmp_path / "what-if-replaying").exists() and s.api(
            "GET", f"/api/engines/wi/what-if/{lost}/").json()["status"] == "running",
            "the replay under way", 60)
        s.kill("ops", signal.SIGKILL)
        failed = {}

        def ended() -> bool:
            failed.update(s.api("GET", f"/api/engines/wi/what-if/{lost}/").json())
            return failed["status"] != "running"

        s.wait(ended, f"what-if run {lost} to end", 30)
        assert failed["status"] == "failed" and "ops worker stopped" in failed["error"], failed
        listed = {r["id"]: r for r in s.api("GET", "/api/engines/wi/what-if/").json()}
        assert listed[lost]["status"] == "failed"

        (tmp_path / "stall-what-if").unlink()
        s.start_ops_worker()
        r = s.api("POST", "/api/engines/wi/what-if/", json={"minutes": 10,
                                                             "num_gpu_blocks": 32})
        assert r.status_code == 202, r.text
        again = {}

        def done() -> bool:
            again.update(s.api("GET", f"/api/engines/wi/what-if/{r.json()['id']}/").json())
            return again["status"] in ("finished", "failed")

        s.wait(done, "the new what-if run", 120)
        assert again["status"] == "finished", again["error"]
        assert again["trace"]["jobs"] == 6
        assert_no_leak(s, "wi")
    finally:
        s.stop()


# --- the web process ------------------------------------------------------------------
def test_the_web_killed_with_streams_open_ends_them_at_once_and_their_jobs_end(tmp_path):
    """SIGKILL the web process while four /v1 streams are open: each client sees its
    connection closed (an error, not its 60 s read timeout), the jobs, which nobody is
    left to cancel, run to their end on the engine, and a web server started again
    serves them and new calls. (Fails if a stream hangs until the client's timeout, or
    a job is left running.)"""
    s = Stack(tmp_path)
    try:
        s.start_web()
        s.start_engine("web", **dict(SIM, simulate_step_ms=20, num_gpu_blocks=64))
        ended: dict[int, BaseException | None] = {}
        job_ids: dict[int, int] = {}
        started = threading.Barrier(5)

        def client(k: int) -> None:
            try:
                with requests.post(f"{s.url}/v1/completions", stream=True, timeout=(5, 60),
                                   headers={"Authorization": f"Bearer {s.tokens['alice']}"},
                                   json={"model": "simulated-v1", "prompt": prompt(400 + k),
                                         "max_tokens": 300, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith(b"data: {") and k not in job_ids:
                            job_ids[k] = int(json.loads(line[6:])["id"].split("-")[1])
                            started.wait()
                ended[k] = None  # (ended cleanly: not expected)
            except BaseException as e:  # noqa: BLE001  (what the client saw)
                ended[k] = e

        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for t in clients:
            t.start()
        started.wait(timeout=60)  # every stream has its first chunk
        s.kill("web", signal.SIGKILL)
        for t in clients:
            t.join(timeout=30)  # (half the clients' read timeout)
        assert not any(t.is_alive() for t in clients), "a stream hung after the kill"
        assert all(isinstance(e, requests.exceptions.ConnectionError) or
                   isinstance(e, requests.exceptions.ChunkedEncodingError)
                   for e in ended.values()), ended
        assert not any(isinstance(e, requests.exceptions.Timeout) for e in ended.values())

        s.restart_web()
        jobs = [s.wait_job(job_ids[k], timeout_s=60, user="alice") for k in range(4)]
        assert all(j["status"] in ("finished", "cancelled") for j in jobs), jobs
        assert all(j["status"] != "finished" or j["num_output_tokens"] == 300 for j in jobs)
        assert texts(run(s, "web", [prompt(450)]))  # the new web server serves
        assert_no_leak(s, "web")
    finally:
        s.stop()


# --- PostgreSQL, and Redis with it ----------------------------------------------------
@pytest.fixture()
def pg_stack(tmp_path):
    """A stack on a private PostgreSQL cluster (tests/session_postgres.start_private:
    its own, so that it can be stopped and started again on its port) and a private
    Redis, one engine."""
    from tests.session_postgres import create_database, start_private, stop_private
    from tests.session_redis import free_port, start_redis

    pg_dir = tempfile.mkdtemp(prefix="kvops-pg-")  # (as root, PostgreSQL runs as postgres,
    # who cannot reach into pytest's folders)
    server, pg = start_private(pg_dir)
    redis_port = free_port()
    redis_proc = start_redis(redis_port, str(tmp_path))
    s = Stack(tmp_path, env={"DATABASE_URL": create_database(server, "kvops_faults"),
                             "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
    s.pg_dir, s.pg, s.pg_port = pg_dir, pg, int(server.rsplit(":", 1)[1].split("/")[0])
    s.redis_port, s.redis_proc = redis_port, redis_proc
    try:
        s.start_web()
        s.start_engine("pg", **dict(SIM, simulate_step_ms=20, num_gpu_blocks=128,
                                    max_num_seqs=8))
        yield s
    finally:
        s.stop()
        s.redis_proc.kill()
        stop_private(pg_dir, s.pg)
        shutil.rmtree(pg_dir, ignore_errors=True)


def submit(stack: Stack, prompts: list[str], max_tokens: int) -> list[int]:
    ids = []
    for text in prompts:
        r = stack.api("POST", "/api/jobs/", json={"prompt": text, "max_tokens": max_tokens})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def test_postgres_restarted_under_running_jobs_loses_nothing_and_writes_nothing_twice(
        pg_stack):
    """A fast shutdown of PostgreSQL (every session ended) and a start on the same data
    and port while eight jobs run: each finishes once, with all its tokens and the text
    a rerun gives, on its first attempt (the writes retry on a fresh connection:
    kvops/jobs/reconnect.py). (Fails if a job's progress or end is written twice or
    lost: its text then differs from the rerun's, or it never ends.)"""
    from tests.session_postgres import start_private, stop_private

    s = pg_stack
    prompts = [prompt(500 + i) for i in range(8)]
    ids = submit(s, prompts, max_tokens=150)  # ~3 s each at 20 ms a step
    s.wait(lambda: all(s.api("GET", f"/api/jobs/{i}/").json()["num_output_tokens"] > 0
                       for i in ids), "every job producing", 60)
    stop_private(s.pg_dir, s.pg)
    _, s.pg = start_private(s.pg_dir, port=s.pg_port)
    jobs = [s.wait_job(i, timeout_s=90) for i in ids]
    assert [(j["status"], j["num_output_tokens"], j["attempts"]) for j in jobs] == \
        [("finished", 150, 1)] * len(ids), [(j["id"], j["status"], j["error"]) for j in jobs]
    rerun = [s.wait_job(i, timeout_s=90) for i in submit(s, prompts, max_tokens=150)]
    assert texts(jobs) == texts(rerun)
    assert_no_leak(s, "pg")


def test_redis_and_postgres_away_together_every_accepted_job_ends(pg_stack):
    """Redis killed and PostgreSQL stopped under eight running jobs, both away for 10 s
    (shorter than the 30 s the code is meant to ride out, to keep the test short; the
    same paths run either way), then started again (Redis empty, as a private one
    comes back): every job accepted before ends, finished with all its tokens or failed
    with a reason, none stays queued or running, and new jobs run. (Fails if a job is
    left running or queued: the wait for its end times out.)"""
    from tests.session_postgres import start_private, stop_private
    from tests.session_redis import start_redis

    s = pg_stack
    ids = submit(s, [prompt(600 + i) for i in range(8)], max_tokens=150)
    s.wait(lambda: all(s.api("GET", f"/api/jobs/{i}/").json()["status"] == "running"
                       for i in ids), "every job running", 60)
    s.redis_proc.kill()
    s.redis_proc.wait()
    stop_private(s.pg_dir, s.pg)
    time.sleep(10)  # the outage itself: both stay away this long
    _, s.pg = start_private(s.pg_dir, port=s.pg_port)
    s.redis_proc = start_redis(s.redis_port, str(s.workdir))
    jobs = [s.wait_job(i, timeout_s=120) for i in ids]
    for j in jobs:
        assert j["status"] in ("finished", "failed"), j
        assert j["status"] == "failed" and j["error"] or j["num_output_tokens"] == 150, j
    (later,) = submit(s, [prompt(650)], max_tokens=5)
    assert s.wait_job(later, timeout_s=60)["status"] == "finished"
    assert_no_leak(s, "pg")
