"""GET /api/jobs/<id>/kv/ on the real stack: every first-miss reason produced by the
situation it names, through the REST endpoint (an engine worker, its core, the output
processor's writes, the router's view), and preemptions with their causes."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

SIM = dict(simulate=1, block_size=16, max_num_seqs=8, simulate_step_ms=5, num_cpu_blocks=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("kvstory")), env={"KVOPS_ROUTING": "prefix"})
    try:
        s.start_web()
        s.manage("shell", "-c", "from django.contrib.auth.models import User; "
                 "User.objects.create_user('bob', password='bob-pass-1234')")
        s.tokens["bob"] = s.manage("drf_create_token", "bob").split()[2]
        for name in ("a", "b"):
            s.start_engine(name, num_gpu_blocks=64, **SIM)
        # a sliding window of 16 tokens over blocks of 4, in a pool of 20 blocks
        s.start_engine("w", simulate=1, block_size=4, num_gpu_blocks=20, num_cpu_blocks=0,
                       simulate_sliding_window=16, max_num_seqs=8, simulate_step_ms=5)
        # a pool too small for three long requests at once
        s.start_engine("p", simulate=1, block_size=16, num_gpu_blocks=12, num_cpu_blocks=0,
                       max_num_seqs=4, simulate_step_ms=5)
        yield s
    finally:
        s.stop()


def run(stack, prompt: str, engine: str, user: str = "admin", **kw) -> dict:
    r = stack.api("POST", "/api/jobs/", user=user,
                  json={"prompt": prompt, "max_tokens": 4, "engine": engine, **kw})
    assert r.status_code == 201, r.text
    return stack.wait_job(r.json()["id"], user=user)


def story(stack, job: dict, user: str = "admin") -> dict:
    r = stack.api("GET", f"/api/jobs/{job['id']}/kv/", user=user)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_full_hit_then_a_miss_evicted_by_a_flood(stack):
    prompt = "The story of prompt one, told twice. " * 5  # 185 tokens: 11 full blocks
    first = story(stack, run(stack, prompt, "a"))
    assert first["told"] and first["engine"] == "a" and first["block_size"] == 16
    assert first["first_miss"]["reason"] == "never_cached"
    assert [b["source"] for b in first["blocks"]] == ["computed"] * 12
    assert first["blocks"][0]["hash"] and first["blocks"][-1]["hash"] is None

    again = story(stack, run(stack, prompt, "a"))
    assert again["first_miss"] is None
    assert again["cached_tokens"] == {"gpu": 176, "cpu": 0, "disk": 0}
    assert [b["source"] for b in again["blocks"]] == ["gpu"] * 11 + ["computed"]
    assert [b["hash"] for b in again["blocks"]] == [b["hash"] for b in first["blocks"]]
    moments = again["moments"]
    assert moments["admitted"] <= moments["first_token"] <= moments["ended"]

    flood = [run(stack, f"flood {i}: " + "unrelated words fill the pool " * 8, "a")
             for i in range(6)]
    evicted = story(stack, run(stack, prompt, "a"))
    miss = evicted["first_miss"]
    assert miss["reason"] == "evicted", miss
    assert miss["by"] in {j["request_id"] for j in flood} and miss["at"]
    assert f"to make room for {miss['by']}" in miss["detail"]


def test_an_operators_reset_and_evict_name_the_operator(stack):
    prompt = "Operators clear caches now and then, and say so. " * 3
    run(stack, prompt, "a")
    assert stack.api("POST", "/api/engines/a/prefix-cache/reset/").status_code == 200
    miss = story(stack, run(stack, prompt, "a"))["first_miss"]
    assert (miss["reason"], miss["by"]) == ("reset", "admin")
    r = stack.api("POST", "/api/engines/a/prefix-cache/evict/", json={})
    assert r.status_code == 200, r.text
    miss = story(stack, run(stack, prompt, "a"))["first_miss"]
    assert (miss["reason"], miss["by"]) == ("operator_evict", "admin")


def test_two_plain_users_same_prompt_different_salts(stack):
    prompt = "Tenants never share a cached prefix unless staff pin one. " * 3
    alices = run(stack, prompt, "a", user="alice")
    bobs = run(stack, prompt, "a", user="bob")
    # bob is told what his own salt's cache says: never cached (a "salt" miss would tell
    # him that another tenant sent these tokens); staff see the engine's reason
    miss = story(stack, bobs, user="bob")["first_miss"]
    assert miss["reason"] == "never_cached" and miss["block"] == 0, miss
    assert story(stack, bobs)["first_miss"]["reason"] == "salt"
    # a story is its job owner's (and staff's): another user gets a 404
    assert stack.api("GET", f"/api/jobs/{alices['id']}/kv/", user="bob").status_code == 404
    assert stack.api("GET", f"/api/jobs/{alices['id']}/kv/", user="admin").status_code == 200


def test_a_prompt_cached_on_one_engine_sent_to_another_by_name(stack):
    prompt = "Routing misses are the router's to explain, not the engine's. " * 3
    on_a = run(stack, prompt, "a")
    on_b = story(stack, run(stack, prompt, "b"))
    assert on_b["routing"]["engine"] == "b" and on_b["routing"]["policy"] == "requested"
    assert on_b["routing"]["best_engine"] == "a"
    assert on_b["routing"]["best_hit_tokens"] >= 16 * (len(prompt) // 16)
    assert on_b["routing"]["hit_tokens"] == 0
    miss = on_b["first_miss"]
    assert miss["reason"] == "other_engine" and "engine a" in miss["detail"], miss
    assert on_a["engine"] == "a"


def test_a_sliding_window_gave_the_blocks_back(stack):
    prompt = "w" * 40  # ten blocks of 4; the window of 16 gives the first ones back
    first = run(stack, prompt, "w", max_tokens=8)
    assert story(stack, first)["window_freed"] > 0
    for i in range(2):
        run(stack, f"{i}" * 40, "w", max_tokens=2)
    miss = story(stack, run(stack, prompt, "w"))["first_miss"]
    assert miss["reason"] == "window", miss


def test_an_operators_preemption_and_a_kv_full_one(stack):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "preempt me, please", "engine": "a",
                                              "max_tokens": 400, "ignore_eos": True})
    job_id = r.json()["id"]
    request_id = stack.wait_running(job_id)
    r = stack.api("POST", f"/api/engines/a/requests/{request_id}/preempt/")
    assert r.status_code == 200, r.text
    told = story(stack, stack.wait_job(job_id))
    [p] = told["preemptions"]
    assert (p["reason"], p["by"]) == ("operator", "admin")
    assert p["recomputed_tokens"] > 0 and told["moments"]["preemptions"] == [p["at"]]

    # three requests that need 5 blocks each at the end, in a pool of 12
    ids = [stack.api("POST", "/api/jobs/", json={
        "prompt": f"request {i} wants room ...", "engine": "p", "max_tokens": 50,
        "ignore_eos": True}).json()["id"] for i in range(3)]
    jobs = [stack.wait_job(i) for i in ids]
    preemptions = [p for j in jobs for p in story(stack, j)["preemptions"]]
    assert preemptions, "the pool was to run short"
    for p in preemptions:  # by the request that needed room (None: it gave way itself,
        # the youngest running, when it was the one that grew)
        assert p["reason"] == "kv_full"
        assert p["by"] is None or p["by"] in {j["request_id"] for j in jobs}, p
        assert p["needed_blocks"] > p["free_blocks"]


def test_another_users_request_ids_are_hidden(stack):
    """A plain user sees another user's request id as 'another user's request'."""
    prompt = "Alice's prompt, to be evicted by the admin's flood. " * 3
    run(stack, prompt, "a", user="alice")
    for i in range(6):
        run(stack, f"admin flood {i}: " + "more unrelated words for the pool " * 8, "a")
    told = story(stack, run(stack, prompt, "a", user="alice"), user="alice")
    miss = told["first_miss"]
    assert miss["reason"] == "evicted" and miss["by"] == "another user's request"
    assert "job-" not in miss["detail"]


def test_metrics_export_the_reasons(stack):
    """After the stories above: /metrics counts them, from the engines' heartbeats."""
    import re

    def sample(text: str, name: str, **labels) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def scraped() -> str:
        return stack.api("GET", "/metrics").text  # (staff's token: /metrics is staff's)

    stack.wait(lambda: sample(scraped(), "kvops:missed_prompt_tokens_by_reason_total",
                              engine="a", reason="operator_evict") > 0, "a heartbeat", 30)
    text = scraped()
    for reason in ("never_cached", "evicted", "reset", "salt", "partial_block"):
        assert sample(text, "kvops:missed_prompt_tokens_by_reason_total", engine="a",
                      reason=reason) > 0, reason
    stack.wait(lambda: sample(scraped(), "kvops:num_preemptions_by_reason_total",
                              engine="p", reason="kv_full") > 0, "p's heartbeat", 30)
    text = scraped()
    assert sample(text, "kvops:num_preemptions_by_reason_total", engine="a",
                  reason="operator") >= 1
    assert sample(text, "kvops:prompt_tokens_by_source_total", engine="a",
                  source="local_cache_hit") >= 176
    assert sample(text, "kvops:prompt_tokens_by_source_total", engine="a",
                  source="local_compute") > 0
    # the job sent to b by name while a held its prefix
    assert sample(text, "kvops:routing_misses_total", engine="b") >= 1
    assert sample(text, "kvops:routing_regret_tokens_total", engine="b") >= 48
    assert re.search(r'^kvops:kv_block_lifetime_seconds_count\{engine="a"\} ', text, re.M)


def test_openai_usage_splits_cached_tokens_by_tier(stack):
    """usage.prompt_tokens_details keeps OpenAI's cached_tokens and adds the split by
    tier (a kvops extension), on /v1/completions and /v1/responses."""
    prompt = "The OpenAI clients see the cached tokens split by tier as well. " * 3
    run(stack, prompt, "a")
    bearer = {"Authorization": f"Bearer {stack.tokens['admin']}"}
    model = stack.api("GET", "/v1/models", user=None, headers=bearer).json()["data"][0]["id"]
    r = stack.api("POST", "/v1/completions", user=None, headers=bearer,
                  json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= 16 * (len(prompt) // 16 - 1)
    assert details["cached_tokens_by_tier"] == {"gpu": details["cached_tokens"], "cpu": 0,
                                                "disk": 0}
    for _ in range(2):  # (its input is rendered as a conversation: the second one hits)
        r = stack.api("POST", "/v1/responses", user=None, headers=bearer,
                      json={"model": model, "input": prompt, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    details = r.json()["usage"]["input_tokens_details"]
    assert details["cached_tokens_by_tier"]["gpu"] == details["cached_tokens"] > 0
    stored = stack.api("GET", f"/v1/responses/{r.json()['id']}", user=None, headers=bearer)
    assert stored.json()["usage"] == r.json()["usage"]  # (read back from its row)


@pytest.mark.django_db(transaction=True)
def test_a_plain_user_is_never_told_salt_nor_another_tenants_hash(client):
    """The audit's oracle: a plain user guessing another tenant's prompt read `salt` and
    that tenant's short hash on her own job's story. She reads `never_cached`, with the
    engine's words for it; staff read the engine's story."""
    from django.contrib.auth.models import User

    from kvops.models import Job
    foreign = "c0ffee12"
    told = {"block_size": 4, "prompt_tokens": 9, "cached_tokens": {"gpu": 0, "cpu": 0, "disk": 0},
            "hashes": ["aa11bb22", "cc33dd44"], "sources": {"gpu": 0, "cpu": 0, "disk": 0},
            "first_miss": {"block": 0, "reason": "salt", "at": None, "by": None,
                           "detail": "the tokens of block 0 are cached under another "
                                     f"tenant's cache salt (hash {foreign}); cache salts "
                                     "keep tenants' prefixes apart"},
            "preemptions": [], "copy_on_write": 0, "window_freed": 0,
            "moments": {"admitted": 1.0, "first_token": None, "preemptions": [], "ended": None}}
    eve = User.objects.create_user("eve", password="mauve-tractor-41-lake")
    staff = User.objects.create_user("op", password="mauve-tractor-41-lake", is_staff=True)
    job = Job.objects.create(owner=eve, prompt="guess 0000", status=Job.Status.FINISHED,
                             engine="a", request_id="job-1-0", kv_story=told)
    client.force_login(eve)
    doc = client.get(f"/api/jobs/{job.pk}/kv/").json()
    assert doc["first_miss"]["reason"] == "never_cached", doc["first_miss"]
    assert doc["first_miss"]["detail"] == ("no block on this engine has held block 0's "
                                           "hash since it started")
    assert "salt" not in str(doc) and foreign not in str(doc)
    assert [b["hash"] for b in doc["blocks"]] == ["aa11bb22", "cc33dd44", None]  # her own
    client.force_login(staff)
    doc = client.get(f"/api/jobs/{job.pk}/kv/").json()
    assert doc["first_miss"]["reason"] == "salt" and foreign in doc["first_miss"]["detail"]
