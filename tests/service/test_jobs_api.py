"""Jobs over REST against a real web server, Redis and engine worker."""

import pytest

from engine.text.detokenizer import SimTokenizer
from engine.model.simulated_runner import reference_generate

def expected_text(prompt: str, n: int) -> str:
    ids = reference_generate(SimTokenizer().encode(prompt), n, 32000)
    return SimTokenizer().decode(ids)


def test_submit_and_finish(stack):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "hello kvops", "max_tokens": 12})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["id"]
    done = stack.wait_job(job["id"])
    assert done["status"] == "finished", done
    assert done["engine"] == "sim" and done["finish_reason"] == "length"
    assert done["num_output_tokens"] == 12 and len(done["output_token_ids"]) == 12
    assert done["output_text"] == expected_text("hello kvops", 12)
    assert done["started_at"] and done["first_token_at"] and done["finished_at"]


def test_shared_prefix_is_reported_as_cached(stack):
    system = "You are a terse assistant. " * 4
    first = stack.api("POST", "/api/jobs/", json={"prompt": system + "one", "max_tokens": 2})
    stack.wait_job(first.json()["id"])
    second = stack.api("POST", "/api/jobs/", json={"prompt": system + "two", "max_tokens": 2})
    done = stack.wait_job(second.json()["id"])
    assert done["num_cached_tokens"] >= 96  # six full blocks of the shared 108 bytes


def test_chat_job(stack):
    r = stack.api("POST", "/api/jobs/", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 201, r.text
    assert stack.wait_job(r.json()["id"])["status"] == "finished"


def test_job_naming_an_engine_and_an_unknown_one(stack):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "x", "max_tokens": 1, "engine": "sim"})
    assert stack.wait_job(r.json()["id"])["engine"] == "sim"
    r = stack.api("POST", "/api/jobs/", json={"prompt": "x", "engine": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_cancel_a_running_job(stack):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "long one", "max_tokens": 3000})
    job_id = r.json()["id"]
    stack.wait(lambda: stack.api("GET", f"/api/jobs/{job_id}/").json()["status"] == "running",
               "job running", 30)
    r = stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    assert r.status_code == 200, r.text
    done = stack.wait_job(job_id)
    assert done["status"] == "cancelled" and done["finish_reason"] == "abort"
    assert "owner" in done["error"]
    r = stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    assert r.status_code == 409


def test_jobs_are_private_to_their_owner(stack):
    r = stack.api("POST", "/api/jobs/", user="alice", json={"prompt": "mine", "max_tokens": 1})
    assert r.status_code == 201
    alice_job = r.json()["id"]
    admin_job = stack.api("POST", "/api/jobs/", json={"prompt": "x", "max_tokens": 1}).json()["id"]
    assert stack.api("GET", f"/api/jobs/{admin_job}/", user="alice").status_code == 404
    assert stack.api("GET", f"/api/jobs/{alice_job}/").status_code == 200  # staff see all
    ids = [j["id"] for j in stack.api("GET", "/api/jobs/", user="alice").json()["results"]]
    assert alice_job in ids and admin_job not in ids


def test_anonymous_is_refused(stack):
    anonymous = stack.api("GET", "/api/jobs/", user=None)
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"] == "Token"
    assert stack.api("POST", "/api/jobs/", user=None, json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("body, field", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "top_k": False}, "top_k"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": 42}, "prompt"),
    ({"messages": [{"role": "wizard", "content": "y"}]}, "messages"),
    ({"messages": "hi"}, "messages"),
])
def test_bad_input_is_a_clear_400(stack, body, field):
    r = stack.api("POST", "/api/jobs/", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_malformed_json_is_a_400(stack):
    r = stack.api("POST", "/api/jobs/", data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_prompt_over_the_model_limit_is_a_400(stack):
    r = stack.api("POST", "/api/jobs/", json={"prompt": "y" * 5000, "max_tokens": 1})
    assert r.status_code == 400
    assert "5000 tokens on engine sim" in r.json()["error"]["message"] and "4095" in r.json()["error"]["message"]
    r = stack.api("POST", "/api/jobs/", json={"prompt": "y" * 4095, "max_tokens": 1})
    assert r.status_code == 201  # the longest prompt that fits



def test_a_retried_submission_with_an_idempotency_key_stores_one_job(stack):
    body = {"prompt": "submitted twice", "max_tokens": 3}
    key = {"Idempotency-Key": "retry-me-1"}
    first = stack.api("POST", "/api/jobs/", json=body, headers=dict(key))
    again = stack.api("POST", "/api/jobs/", json=body, headers=dict(key))
    assert first.status_code == again.status_code == 201, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert "Idempotent-Replayed" not in first.headers
    # Another user's key is theirs: the same key stores alice a job of her own.
    hers = stack.api("POST", "/api/jobs/", json=body, headers=dict(key), user="alice")
    assert hers.status_code == 201 and hers.json()["id"] != first.json()["id"]
    # The same key for another job is refused; a key that is not one is a 400.
    other = stack.api("POST", "/api/jobs/", json={**body, "max_tokens": 4}, headers=dict(key))
    assert other.status_code == 409 and "another request" in other.text, other.text
    bad = stack.api("POST", "/api/jobs/", json=body, headers={"Idempotency-Key": "k" * 129})
    assert bad.status_code == 400 and "Idempotency-Key" in bad.text
    assert stack.wait_job(first.json()["id"])["status"] == "finished"


def test_the_api_docs_are_served_without_a_cdn(stack):
    import re
    page = stack.api("GET", "/api/docs/")
    assert page.status_code == 200, page.text
    assert "cdn.jsdelivr" not in page.text and "unpkg" not in page.text
    scripts = re.findall(r'src="([^"]+\.js)"', page.text)
    assert any("drf_spectacular_sidecar" in s for s in scripts), scripts
    for src in scripts:  # every script comes from this server
        assert src.startswith("/static/"), src
        assert stack.api("GET", src, user=None).status_code == 200, src


def test_users_do_not_share_prefix_caches_but_share_pinned_prefixes(stack):
    """KVOPS_PREFIX_SHARING=user (the default): alice's blocks are hers; a staff user's
    same prompt finds nothing of them; a prefix an operator pinned is shared with all."""
    def run(prompt: str, user: str) -> dict:
        r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 2}, user=user)
        assert r.status_code == 201, r.text
        return stack.wait_job(r.json()["id"], user=user)

    private = "alice keeps this preamble to herself, block after block. " * 3
    run(private + "one", "alice")
    assert run(private + "two", "alice")["num_cached_tokens"] >= 96  # her own cache
    assert run(private + "three", "admin")["num_cached_tokens"] == 0  # not another user's

    published = "Operators publish this system prompt to everyone, on purpose. " * 3
    run(published + "warm", "admin")
    pin = stack.api("POST", "/api/engines/sim/prefix-cache/pin/", json={"prompt": published})
    assert pin.status_code == 200, pin.text
    try:
        pinned_tokens = len(pin.json()["result"]["block_ids"]) * 16
        assert pinned_tokens >= 96
        assert run(published + "question", "alice")["num_cached_tokens"] >= pinned_tokens
        # The operator log shows the pinned prompt to staff only.
        logged = [a for a in stack.api("GET", "/api/actions/", user="alice").json()["results"]
                  if a["action"] == "pin"][0]
        assert logged["params"]["prompt"] == "(hidden: staff only)"
        page = signed_in(stack, "alice", "alice-pass-123").get(f"{stack.url}/actions/",
                                                                timeout=30)
        assert page.url.endswith("/actions/") and "pin" in page.text
        assert published not in page.text and "(hidden: staff only)" in page.text
        staff_view = [a for a in stack.api("GET", "/api/actions/").json()["results"]
                      if a["action"] == "pin"][0]
        assert staff_view["params"]["prompt"] == published
    finally:
        stack.api("POST", "/api/engines/sim/prefix-cache/unpin/", json={"prompt": published})


def signed_in(stack, username: str, password: str):
    """A browser-like session, logged in through the login page."""
    import requests
    session = requests.Session()
    session.get(f"{stack.url}/accounts/login/", timeout=30)
    r = session.post(f"{stack.url}/accounts/login/", timeout=30, data={
        "username": username, "password": password,
        "csrfmiddlewaretoken": session.cookies["csrftoken"]}, headers={"Referer": stack.url})
    assert r.status_code == 200 and not r.url.endswith("/login/"), r.url
    return session


def test_cancel_a_running_job_with_samples(stack):
    """n > 1: cancelling the job aborts every sample (the parent's request id names them
    all), the job ends once, and no sample is left on the engine."""
    r = stack.api("POST", "/api/jobs/", json={"prompt": "forked long one", "max_tokens": 3000,
                                              "n": 3, "ignore_eos": True})
    job_id = r.json()["id"]
    stack.wait(lambda: stack.api("GET", f"/api/jobs/{job_id}/").json()["num_output_tokens"] > 0,
               "samples producing", 30)
    assert stack.api("POST", f"/api/jobs/{job_id}/cancel/").status_code == 200
    done = stack.wait_job(job_id)
    assert done["status"] == "cancelled" and len(done["samples"]) == 3
    assert all(s["finish_reason"] == "abort" for s in done["samples"])

    def blocks_freed() -> bool:  # (ended requests stay listed a while, without blocks)
        snapshot = stack.api("GET", f"/api/engines/{done['engine']}/").json()["snapshot"]
        return not any(q["block_table"] or q["status"] in ("running", "waiting", "swapped")
                       for q in snapshot["requests"]
                       if q["request_id"].startswith(done["request_id"] + "/"))
    stack.wait(blocks_freed, "the samples to release their blocks", 30)
