"""Prefix-aware routing across two engine workers."""
from pathlib import Path

import redis

import pytest

from tests.support.stack import Stack

SYSTEM_A = "System prompt A: answer in French, briefly. " * 3
SYSTEM_B = "System prompt B: you are a careful code reviewer. " * 3


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("routing")), env={"KVOPS_ROUTING": "prefix"})
    try:
        s.start_web()
        for name in ("east", "west"):
            s.start_engine(name, simulate=1, num_gpu_blocks=256, block_size=16,
                           max_num_seqs=8, simulate_step_ms=5)
        yield s
    finally:
        s.stop()


def submit(stack, prompt, **kw):
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 4, **kw})
    assert r.status_code == 201, r.text
    return stack.wait_job(r.json()["id"])


def test_jobs_follow_their_cached_prefix(two_engines):
    first = submit(two_engines, SYSTEM_A + "question 1")
    home_a = first["engine"]
    assert first["routing"]["policy"] == "prefix"
    assert first["routing"]["reason"].startswith("no engine holds")
    second = submit(two_engines, SYSTEM_A + "question 2")
    assert second["engine"] == home_a
    assert second["routing"]["cached_blocks"][home_a] >= len(SYSTEM_A) // 16
    assert "longest cached prefix" in second["routing"]["reason"]
    assert second["num_cached_tokens"] >= (len(SYSTEM_A) // 16) * 16
    other = submit(two_engines, SYSTEM_B + "question 3")
    assert other["routing"]["cached_blocks"] == {"east": 0, "west": 0}


def test_a_named_engine_wins(two_engines):
    job = submit(two_engines, SYSTEM_A + "question 4", engine="west")
    assert job["engine"] == "west" and job["routing"]["policy"] == "requested"


def test_evicted_prefixes_leave_the_index(two_engines):
    first = submit(two_engines, SYSTEM_B + "again")
    home = first["engine"]
    r = two_engines.api("POST", f"/api/engines/{home}/prefix-cache/reset/")
    assert r.status_code == 200

    index = redis.Redis.from_url(two_engines.env["REDIS_URL"])
    two_engines.wait(lambda: index.scard(f"kvops:prefix:{home}") == 0,
                     "index emptied by the reset", 10)
    again = submit(two_engines, SYSTEM_B + "after the reset")
    assert again["routing"]["cached_blocks"][home] == 0
    assert again["num_cached_tokens"] == 0  # only `home` ever held prompt B


def test_a_paused_engine_takes_no_routed_jobs_until_resumed(two_engines):
    """Pause the engine holding prompt A's prefix: jobs go to the other one (its state
    reaches the router with the next heartbeat); a job naming the paused engine waits
    there; resume, and it runs, and routing comes back."""
    home = submit(two_engines, SYSTEM_A + "before the pause")["engine"]
    other = "west" if home == "east" else "east"
    assert two_engines.api("POST", f"/api/engines/{home}/pause/").json()["ok"]
    two_engines.wait(lambda: two_engines.api("GET", f"/api/engines/{home}/").json()
                     ["engine"]["state"] == "paused", "the paused state in the API", 15)
    moved = submit(two_engines, SYSTEM_A + "during the pause")
    assert moved["engine"] == other  # though `home` holds the prefix
    assert home not in moved["routing"]["load_tokens"]  # not a candidate
    named = two_engines.api("POST", "/api/jobs/", json={
        "prompt": "wait for me", "max_tokens": 2, "engine": home}).json()
    assert two_engines.api("GET", f"/api/jobs/{named['id']}/").json()["status"] in (
        "queued", "running")
    assert two_engines.api("POST", f"/api/engines/{home}/resume/").json()["ok"]
    assert two_engines.wait_job(named["id"])["status"] == "finished"
    two_engines.wait(lambda: two_engines.api("GET", f"/api/engines/{home}/").json()
                     ["engine"]["state"] == "ready", "the ready state in the API", 15)
    after = submit(two_engines, SYSTEM_A + "after the pause")  # (both hold the prefix now)
    assert home in after["routing"]["load_tokens"]  # a candidate again
    refused = two_engines.api("POST", f"/api/engines/{home}/pause/", user="alice")
    assert refused.status_code == 403


def test_a_draining_engine_finishes_its_jobs_and_takes_no_new_ones(two_engines):
    """Drain the engine holding prompt B's prefix while a long job runs there: new jobs
    go to the other engine, the running one finishes, the state goes draining then
    drained; undrain, and routing comes back."""
    home = submit(two_engines, SYSTEM_B + "before the drain")["engine"]
    other = "west" if home == "east" else "east"
    long = two_engines.api("POST", "/api/jobs/", json={
        "prompt": SYSTEM_B + "a long one", "max_tokens": 300, "engine": home}).json()
    two_engines.wait_running(long["id"])
    answer = two_engines.api("POST", f"/api/engines/{home}/drain/").json()
    assert answer["ok"] and answer["result"]["state"] == "draining"
    assert two_engines.api("GET", f"/api/engines/{home}/").json()["engine"]["state"] in (
        "draining", "drained")
    assert submit(two_engines, SYSTEM_B + "during the drain")["engine"] == other
    assert two_engines.wait_job(long["id"])["status"] == "finished"
    two_engines.wait(lambda: two_engines.api("GET", f"/api/engines/{home}/").json()
                     ["engine"]["state"] == "drained", "drained once its job ended", 15)
    assert two_engines.api("POST", f"/api/engines/{home}/undrain/").json()["ok"]
    assert two_engines.api("GET", f"/api/engines/{home}/").json()["engine"]["state"] == "ready"
    after = submit(two_engines, SYSTEM_B + "after the drain")
    assert home in after["routing"]["load_tokens"]
