"""POST /api/engines/<name>/what-if/ and GET .../what-if/<id>/ on a real stack: a
simulated engine runs jobs, the ops worker (a Celery worker of its own) replays them
under the engine's configuration and an alternative; refusals are 4xx with a message;
every start is in the operator log."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

SYSTEM = "You are the KV cache of a serving engine. Say how blocks are shared. "


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Every worker logs the tasks it runs (KVOPS_LOG_TASKS).
    s = Stack(Path(tmp_path_factory.mktemp("what-if")), env={"KVOPS_LOG_TASKS": "1"})
    try:
        s.start_web()
        s.start_engine("wi", simulate=1, vocab_size=32000, num_gpu_blocks=64,
                       num_cpu_blocks=32, block_size=16, max_num_seqs=8, simulate_step_ms=2)
        s.start_ops_worker()
        yield s
    finally:
        s.stop()


def what_if(stack, body: dict, user: str = "admin", engine: str = "wi"):
    return stack.api("POST", f"/api/engines/{engine}/what-if/", user=user, json=body)


def run_jobs(stack, n: int) -> list[dict]:
    ids = []
    for i in range(n):
        r = stack.api("POST", "/api/jobs/", json={
            "prompt": SYSTEM + f"Question {i}: " + "why? " * (i % 5 + 1),
            "max_tokens": 40 + 10 * (i % 4), "engine": "wi"})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return [stack.wait_job(job_id, timeout_s=120) for job_id in ids]



def wait_run(stack, run_id: int) -> dict:
    """The run once it has finished or failed."""
    run = {}

    def ended() -> bool:
        run.update(stack.api("GET", f"/api/engines/wi/what-if/{run_id}/").json())
        return run["status"] in ("finished", "failed")

    stack.wait(ended, f"what-if run {run_id}", 120)
    return run

def test_nothing_to_replay_before_any_job(stack):
    r = what_if(stack, {"minutes": 5})
    assert r.status_code == 400 and "nothing to replay" in r.json()["error"]["message"]


def test_a_what_if_runs_on_the_ops_worker_and_returns_both_replays(stack):
    jobs = run_jobs(stack, 12)
    assert all(j["status"] == "finished" for j in jobs)
    r = what_if(stack, {"minutes": 10, "num_gpu_blocks": 16, "preemption_mode": "swap",
                        "max_num_seqs": 4, "cpu_prefix_cache": True})
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    assert r.json()["status"] == "queued" and r.json()["engine"] == "wi"

    run = wait_run(stack, run_id)
    assert run["status"] == "finished", run["error"]
    assert run["progress"] == 1.0 and run["user"] == "admin"
    assert run["trace"]["jobs"] == 12 and run["trace"]["prefix_groups"] == 1
    assert run["trace"]["prompt_tokens"] == sum(j["num_prompt_tokens"] for j in jobs)
    base, alt = run["baseline"], run["alternative"]
    assert (base["config"]["num_gpu_blocks"], base["config"]["preemption_mode"],
            base["config"]["max_num_seqs"]) == (64, "recompute", 8)
    assert (alt["config"]["num_gpu_blocks"], alt["config"]["preemption_mode"],
            alt["config"]["max_num_seqs"], alt["config"]["cpu_prefix_cache"]) == \
        (16, "swap", 4, True)
    for result in (base, alt):
        assert result["requests"] == 12
        for key in ("kv_usage_mean", "kv_usage_peak", "prefix_hit_rate", "preemptions",
                    "queue_wait_p50", "queue_wait_p99", "sim_seconds", "output_tokens_per_s"):
            assert result[key] is not None, key
        assert len(result["timeline"]["gpu"]) == 200
    assert alt["kv_usage_peak"] >= base["kv_usage_peak"]  # a quarter of the pool
    assert base["prefix_hit_rate"] > 0  # the shared system prompt

    # The ops worker ran it; the engine worker did not (both list the task at start).
    assert "Task kvops.what_if[" in stack.log("ops")
    assert "Task kvops.run_jobs[" in stack.log("engine-wi")
    assert "Task kvops.what_if[" not in stack.log("engine-wi")
    # Audited, and listed.
    actions = stack.api("GET", "/api/actions/").json()
    rows = actions["results"] if isinstance(actions, dict) else actions
    assert any(a["action"] == "what-if" and a["target"] == str(run_id) and a["engine"] == "wi"
               for a in rows)
    listed = stack.api("GET", "/api/engines/wi/what-if/").json()
    assert listed[0]["id"] == run_id


def test_a_sweep_runs_each_value_and_returns_their_replays(stack):
    if not stack.api("GET", "/api/jobs/?engine=wi").json()["count"]:
        run_jobs(stack, 6)  # (run alone)
    r = what_if(stack, {"minutes": 10, "max_num_seqs": 4,
                        "sweep": {"lever": "eviction_policy", "values": ["slru", "lfu"]}})
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    assert r.json()["params"]["sweep"] == {"lever": "eviction_policy", "values": ["slru", "lfu"]}
    run = wait_run(stack, run_id)
    assert run["status"] == "finished", run["error"]
    assert run["alternative"] == {} and run["sweep"]["lever"] == "eviction_policy"
    assert [(r["value"], r["config"]["eviction_policy"], r["config"]["max_num_seqs"])
            for r in run["sweep"]["results"]] == [("slru", "slru", 4), ("lfu", "lfu", 4)]
    assert run["baseline"]["config"]["eviction_policy"] == "lru"
    for result in run["sweep"]["results"]:
        assert result["prefix_hit_rate"] > 0 and result["ttft_p50"] is not None


def test_a_retry_with_the_same_idempotency_key_gets_the_first_run(stack):
    """(After the test above has run jobs.) The same key and body: the first call's run,
    marked replayed, one run and one audit row; the key with another body: 409."""
    body = {"minutes": 10, "num_gpu_blocks": 32}
    key = {"Idempotency-Key": "what-if-retry-1"}
    first = stack.api("POST", "/api/engines/wi/what-if/", json=body, headers=dict(key))
    assert first.status_code == 202, first.text
    assert "Idempotent-Replayed" not in first.headers
    again = stack.api("POST", "/api/engines/wi/what-if/", json=body, headers=dict(key))
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    other = stack.api("POST", "/api/engines/wi/what-if/", json={"minutes": 10,
                                                                 "num_gpu_blocks": 48},
                      headers=dict(key))
    assert other.status_code == 409 and "another action" in other.json()["error"]["message"]
    bad = stack.api("POST", "/api/engines/wi/what-if/", json=body,
                    headers={"Idempotency-Key": "x" * 500})
    assert bad.status_code == 400 and "Idempotency-Key" in bad.text
    actions = stack.api("GET", "/api/actions/").json()
    rows = actions["results"] if isinstance(actions, dict) else actions
    assert sum(a["action"] == "what-if" and a["target"] == str(first.json()["id"])
               for a in rows) == 1
    runs = stack.api("GET", "/api/engines/wi/what-if/").json()
    assert sum(r["params"] == first.json()["params"] for r in runs) == 1


@pytest.mark.parametrize("body, status, words", [
    ({"block_size": 3}, 400, "block_size"),
    ({"minutes": 0}, 400, "minutes"),
    ({"minutes": 100000}, 400, "minutes"),
    ({"max_jobs": 20001}, 400, "max_jobs"),
    ({"num_gpu_blocks": 0}, 400, "num_gpu_blocks"),
    ({"preemption_mode": "teleport"}, 400, "preemption_mode"),
    ({"preemption_mode": "swap", "num_cpu_blocks": 0}, 400, "num_cpu_blocks > 0"),
    ({"num_gpu_blocks": 2}, 400, "cannot hold the longest job"),
    ({"step_base_ms": 0}, 400, "step_base_ms"),
    ({"max_num_seqs": "many"}, 400, "max_num_seqs"),
    ({"pool": 5}, 400, "unknown field"),
    ({"pin_budget": 2}, 400, "pin_budget"),
    ({"pin_budget": "half"}, 400, "pin_budget"),
    ({"kv_cache_dtype": "fp4"}, 400, "kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_e4m3"}, 400, "real model"),  # (the engine is simulated)
    ({"eviction_policy": "mru"}, 400, "eviction_policy"),
    ({"disk_cache_bytes": -1}, 400, "disk_cache_bytes"),
    ([1, 2], 400, "JSON object"),
    ({"sweep": {"lever": "model", "values": [1, 2]}}, 400, "lever"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64]}}, 400, "values"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": list(range(64, 73))}}, 400, "no more than 8"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, "lots"]}}, 400, "valid integer"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, None]}}, 400, "null"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, 0]}}, 400, "values"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, 64]}}, 400, "more than once"),
    ({"sweep": {"lever": "eviction_policy", "values": ["lru", "mru"]}}, 400, "mru"),
    ({"sweep": {"lever": "pin_budget", "values": [0.5, "half"]}}, 400, "values"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, 128]}, "num_gpu_blocks": 32}, 400,
     "num_gpu_blocks is swept"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, 2]}}, 400,
     "the sweep's num_gpu_blocks = 2 pool"),
    ({"sweep": {"lever": "kv_cache_dtype", "values": ["fp8_e4m3", "auto"]}}, 400, "real model"),
    ({"sweep": {"lever": "num_gpu_blocks", "values": [64, 128], "step": 2}}, 400, "unknown field"),
    ({"sweep": [64, 128]}, 400, "JSON object"),
])
def test_bad_requests_are_400_with_a_message(stack, body, status, words):
    r = what_if(stack, body)
    assert r.status_code == status, r.text
    assert words in r.text


def test_only_operators_and_only_known_engines_and_runs(stack):
    r = what_if(stack, {}, user="alice")
    assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    assert stack.api("GET", "/api/engines/wi/what-if/", user="alice").status_code == 403
    assert what_if(stack, {}, engine="nosuch").status_code == 404
    assert stack.api("GET", "/api/engines/wi/what-if/987654/").status_code == 404
    assert stack.api("GET", f"/api/engines/wi/what-if/{2 ** 70}/").status_code == 404
