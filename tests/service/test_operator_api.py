"""Operator actions over HTTP change the engine; every one is audited."""

import pytest

from engine.observe.snapshot import decode_array


def start_long_job(stack, tokens=3000):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "operator test " * 3, "max_tokens": tokens})
    job_id = r.json()["id"]
    return job_id, stack.wait_running(job_id, 30)


def request_entry(stack, request_id):
    snap = {}

    def fresh():
        snap.update(stack.api("GET", "/api/engines/sim/").json()["snapshot"] or {})
        return any(r["request_id"] == request_id for r in snap.get("requests", []))

    stack.wait(fresh, "snapshot with the request", 10)
    return snap, next(r for r in snap["requests"] if r["request_id"] == request_id)


def act(stack, request_id, action, user="admin"):
    return stack.api("POST", f"/api/engines/sim/requests/{request_id}/{action}/", user=user)


def test_swap_out_swap_in_preempt_abort(stack):
    job_id, rid = start_long_job(stack)
    r = act(stack, rid, "swap-out")
    assert r.status_code == 200, r.text
    assert r.json()["ok"] and r.json()["result"]["status"] == "swapped"
    cpu_table = r.json()["result"]["cpu_block_table"]
    assert cpu_table

    def swapped_in_snapshot():
        snap, entry = request_entry(stack, rid)
        return entry["status"] == "swapped" and entry["cpu_block_table"] == cpu_table \
            and not entry["block_table"]

    stack.wait(swapped_in_snapshot, "snapshot showing the swap", 10)
    r = act(stack, rid, "swap-out")
    assert r.status_code == 409 and "swapped" in r.json()["error"]["message"]
    r = act(stack, rid, "swap-in")
    assert r.status_code == 200 and r.json()["result"]["status"] == "running"
    r = act(stack, rid, "preempt")
    # (its swap out and in counts as a swap, not a preemption)
    assert r.status_code == 200 and r.json()["result"]["num_preemptions"] == 1
    r = act(stack, rid, "abort")
    assert r.status_code == 200
    done = stack.wait_job(job_id)
    assert done["status"] == "cancelled" and "operator" in done["error"]
    assert done["num_preemptions"] == 1
    r = act(stack, rid, "abort")
    assert r.status_code == 409 and "finished" in r.json()["error"]["message"]
    log = stack.api("GET", "/api/actions/").json()["results"]
    mine = [a for a in log if a["target"] == rid]
    assert [a["action"] for a in reversed(mine)] == ["swap-out", "swap-out", "swap-in",
                                                     "preempt", "abort", "abort"]
    assert [a["status_code"] for a in reversed(mine)] == [200, 409, 200, 200, 200, 409]
    assert all(a["user"] == "admin" for a in mine)


def test_unknown_request_engine_and_action(stack):
    assert act(stack, "no-such-request", "preempt").status_code == 404
    r = stack.api("POST", "/api/engines/nope/requests/x/preempt/")
    assert r.status_code == 404
    r = stack.api("POST", "/api/engines/sim/requests/x/explode/")
    assert r.status_code == 404 and "explode" in r.json()["error"]["message"]


def test_non_staff_cannot_act(stack):
    r = act(stack, "whatever", "abort", user="alice")
    assert r.status_code == 403
    r = stack.api("POST", "/api/engines/sim/prefix-cache/reset/", user="alice")
    assert r.status_code == 403
    r = act(stack, "whatever", "abort", user=None)
    assert r.status_code == 401


def test_prefix_cache_pin_evict_reset(stack):
    prompt = "The pinned system prompt. " * 4
    job = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 1}).json()
    stack.wait_job(job["id"])
    r = stack.api("POST", "/api/engines/sim/prefix-cache/pin/", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    pinned = r.json()["result"]["block_ids"]
    assert len(pinned) == len(prompt.encode()) // 16
    r = stack.api("POST", "/api/engines/sim/prefix-cache/evict/", json={})
    assert r.status_code == 200  # every cached block not pinned: other tests' too
    # a prompt of three full blocks of its own, cached unpinned, and evicted: exactly three
    fresh = stack.api("POST", "/api/jobs/", json={"prompt": "evict-me-" * 6 + "x" * 2,
                                                   "max_tokens": 1}).json()
    stack.wait_job(fresh["id"])
    r = stack.api("POST", "/api/engines/sim/prefix-cache/evict/", json={})
    assert r.status_code == 200 and r.json()["result"]["num_evicted"] == 3, r.text

    def pinned_in_snapshot():
        snap = stack.api("GET", "/api/engines/sim/").json()["snapshot"]
        states = decode_array(snap["gpu"]["state"])
        return all(states[b] == snap["block_states"].index("pinned") for b in pinned)

    stack.wait(pinned_in_snapshot, "pinned blocks in the snapshot", 10)
    r = stack.api("POST", "/api/engines/sim/prefix-cache/unpin/", json={"prompt": prompt})
    assert r.status_code == 200 and r.json()["result"]["num_unpinned"] == len(pinned)
    r = stack.api("POST", "/api/engines/sim/prefix-cache/reset/")
    assert r.status_code == 200 and r.json()["result"]["num_blocks_forgotten"] >= len(pinned)
    r = stack.api("POST", "/api/engines/sim/prefix-cache/pin/", json={"prompt": prompt})
    assert r.status_code == 409 and "cached" in r.json()["error"]["message"]


@pytest.mark.parametrize("action, body", [
    ("evict", {"num_blocks": -1}), ("evict", {"num_blocks": "all"}), ("pin", {}),
    ("pin", {"prompt": "x", "token_ids": [1]}), ("pin", {"token_ids": [-5]}),
    ("reset", {"extra": 1}),
])
def test_prefix_cache_bad_input(stack, action, body):
    r = stack.api("POST", f"/api/engines/sim/prefix-cache/{action}/", json=body)
    assert r.status_code == 400, r.text


def test_engine_list_and_snapshot(stack):
    engines = stack.api("GET", "/api/engines/").json()
    sim = next(e for e in engines if e["name"] == "sim")
    assert sim["alive"] and sim["config"]["num_gpu_blocks"] == 512
    assert sim["heartbeat_age_s"] < 5
    detail = stack.api("GET", "/api/engines/sim/").json()
    snap = detail["snapshot"]
    assert snap["engine"] == "sim" and len(decode_array(snap["gpu"]["state"])) == 512
    assert stack.api("GET", "/api/engines/nope/").status_code == 404


def test_a_worker_that_does_not_answer_is_a_504(stack):
    from kvops.models import Engine  # noqa: F401  (the row is made over the API below)
    stack.manage("shell", "-c", "from kvops.models import Engine; Engine.objects.create("
                 "name='ghost', worker='engine-ghost@nowhere', status='ready')")
    r = stack.api("POST", "/api/engines/ghost/prefix-cache/reset/")
    assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]


def test_a_retried_action_with_an_idempotency_key_happens_once(stack):
    def evicts() -> int:  # every action recorded so far (other tests' too)
        return stack.api("GET", "/api/actions/").json()["count"]

    before = evicts()
    key = {"Idempotency-Key": "evict-once-1"}
    first = stack.api("POST", "/api/engines/sim/prefix-cache/evict/", json={"num_blocks": 1},
                      headers=dict(key))
    assert first.status_code == 200, first.text
    again = stack.api("POST", "/api/engines/sim/prefix-cache/evict/", json={"num_blocks": 1},
                      headers=dict(key))
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert evicts() == before + 1  # sent and recorded once
    other = stack.api("POST", "/api/engines/sim/prefix-cache/reset/", headers=dict(key))
    assert other.status_code == 409 and "another action" in other.text, other.text


def test_the_pin_budget_is_set_live_and_refuses_a_pin_over_it(stack):
    """POST /api/engines/<name>/retention/ sets the pin budget (audited); a pin past it is
    a 409 naming the budget; the engine's metrics carry the budget."""
    prompt = "A prefix to pin under a budget. " * 3
    job = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 1}).json()
    stack.wait_job(job["id"])
    try:
        r = stack.api("POST", "/api/engines/sim/retention/", json={"pin_budget": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["result"]["pin_budget"] == 0.0
        r = stack.api("POST", "/api/engines/sim/prefix-cache/pin/", json={"prompt": prompt})
        assert r.status_code == 409 and "pin budget of 0 blocks" in r.json()["error"]["message"], r.text
        # a soft pin counts against no budget (it takes no block from a request)
        r = stack.api("POST", "/api/engines/sim/prefix-cache/pin/",
                      json={"prompt": prompt, "soft": True, "priority": -1, "ttl_s": 600})
        assert r.status_code == 200 and r.json()["result"]["soft"], r.text
        assert r.json()["result"]["num_newly_pinned"] == len(prompt.encode()) // 16
        r = stack.api("POST", "/api/engines/sim/prefix-cache/unpin/",
                      json={"prompt": prompt, "soft": True})
        assert r.status_code == 200 and r.json()["result"]["num_unpinned"] > 0, r.text
        assert stack.api("POST", "/api/engines/sim/prefix-cache/pin/",
                         json={"prompt": prompt, "ttl_s": 60}).status_code == 400
        stack.wait(lambda: next(e for e in stack.api("GET", "/api/engines/").json()
                                if e["name"] == "sim")["metrics"].get("pin_budget") == 0.0,
                   "the budget in the metrics", 10)
        assert stack.api("POST", "/api/engines/sim/retention/", json={"pin_budget": 2}
                         ).status_code == 400
        assert stack.api("POST", "/api/engines/sim/retention/", json={}).status_code == 400
        r = stack.api("POST", "/api/engines/sim/retention/", json={"eviction_policy": "slru"})
        assert r.status_code == 200 and r.json()["result"]["eviction_policy"] == "slru", r.text
        assert stack.api("POST", "/api/engines/sim/retention/",
                         json={"eviction_policy": "random"}).status_code == 400
        assert stack.api("POST", "/api/engines/sim/retention/", json={"pin_budget": 0.5},
                         user="alice").status_code == 403
        log = stack.api("GET", "/api/actions/").json()["results"]
        assert any(a["action"] == "retention" and a["params"] == {"pin_budget": 0.0}
                   for a in log)
    finally:
        r = stack.api("POST", "/api/engines/sim/retention/",
                      json={"pin_budget": 0.5, "eviction_policy": "lru"})
        assert r.status_code == 200


def test_a_tenants_quota_is_set_live_by_user_and_audited(stack):
    """POST /api/engines/<name>/tenants/ names a user; the engine gets the user's tenant
    label, answers the tenant's limits (its cached blocks counted from alice's own job),
    and the operator log keeps the action under the user's name."""
    job = stack.api("POST", "/api/jobs/", user="alice",
                    json={"prompt": "Alice's prefix, long enough for two blocks. " * 2,
                          "max_tokens": 1}).json()
    stack.wait_job(job["id"], user="alice")
    try:
        r = stack.api("POST", "/api/engines/sim/tenants/",
                      json={"user": "alice", "cache_quota": 0.25})
        assert r.status_code == 200, r.text
        limits = r.json()["result"]
        assert limits["cache_quota"] == 0.25 and limits["own_cache_quota"], limits
        assert limits["cached_blocks"] >= 2 and len(limits["tenant"]) == 16, limits
        assert stack.api("POST", "/api/engines/sim/tenants/", user="alice",
                         json={"user": "alice", "cache_quota": 1.0}).status_code == 403
        r = stack.api("POST", "/api/engines/sim/tenants/", json={"user": "alice", "weight": 2})
        assert r.status_code == 400 and "vtc" in r.json()["error"]["message"], r.text
        log = stack.api("GET", "/api/actions/").json()["results"]
        assert any(a["action"] == "tenant" and a["target"] == "alice"
                   and a["params"].get("cache_quota") == 0.25 for a in log)
    finally:
        r = stack.api("POST", "/api/engines/sim/tenants/",
                      json={"user": "alice", "clear": ["cache_quota"]})
        assert r.status_code == 200 and not r.json()["result"]["own_cache_quota"], r.text
