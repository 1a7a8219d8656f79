"""The overview's "Which engine holds this prefix?" box, in headless Chromium against the
real stack (uvicorn, two simulated engine workers, Redis, SQLite): a user pastes the
prompt a job of theirs ran and sees which engine holds how much of it, tier by tier, in
the router's index and in the engine's answer; a bad entry is said in words. And the job
page's pin goes to the engine the job ran on, not another. The answer's rules:
tests/service/test_prefix_lookup.py; the box's logic: tests/dashboard/js/prefix_lookup.test.mjs."""
import uuid
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
BLOCK = 16  # the byte tokenizer: one token per UTF-8 byte
RAN_ON, OTHER = "west", "east"
SUMMARY_SAYS = "(what) => document.querySelector('#lookup-summary').textContent.includes(what)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("lookup-browser")))
    try:
        s.start_web()
        s.start_engine(OTHER, simulate=1, block_size=BLOCK, num_gpu_blocks=256,
                       num_cpu_blocks=64, cpu_prefix_cache=1)
        s.start_engine(RAN_ON, simulate=1, block_size=BLOCK, num_gpu_blocks=256,
                       num_cpu_blocks=0)
        yield s
    finally:
        s.stop()


def completion(stack, user: str) -> tuple[dict, str]:
    """A finished job of `user`'s on RAN_ON, of a prompt of its own (10 blocks and 3)."""
    prompt = (f"[{uuid.uuid4().hex}] " + "the console stays open all night. " * 10)[:163]
    r = stack.api("POST", "/api/jobs/", user=user,
                  json={"prompt": prompt, "max_tokens": 2, "engine": RAN_ON})
    assert r.status_code == 201, r.text
    job = stack.wait_job(r.json()["id"], user=user)
    assert job["status"] == "finished" and job["engine"] == RAN_ON, job
    return job, prompt


def cells(page, engine: str, view: str) -> list[str]:
    return page.locator(f'#lookup-table tr[data-engine="{engine}"][data-view="{view}"] td'
                        ).all_inner_texts()


def test_a_user_looks_up_their_prompt_and_sees_where_it_is_cached(login, stack):
    job, prompt = completion(stack, "alice")

    def indexed() -> bool:  # (the router's index follows the engine's KV feed)
        answer = stack.api("POST", "/api/prefix-lookup/", user="alice", json={"text": prompt})
        return next(e for e in answer.json()["engines"]
                    if e["engine"] == RAN_ON)["router"]["total"] == 160

    stack.wait(indexed, "the prompt in the router's index", 15)
    page, errors = login(stack, "alice", "alice-pass-123")
    assert page.locator("#lookup-form input[name=user]").count() == 0  # (staff's only)
    page.fill("#lookup-form textarea[name=prefix]", prompt)
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg="holds the longest")
    assert page.inner_text("#lookup-summary") == (
        f"{RAN_ON} holds the longest cached prefix under alice's cache salt: 160 of 163 tokens.")
    assert cells(page, RAN_ON, "engine's answer") == [RAN_ON, "engine's answer", "160", "–", "–", "160"]
    assert cells(page, RAN_ON, "router's index") == [RAN_ON, "router's index", "160", "0", "–", "160"]
    assert cells(page, OTHER, "engine's answer") == [OTHER, "engine's answer", "0", "0", "–", "0"]

    # the same by job id; then what is wrong, in words
    page.select_option("#lookup-form select[name=mode]", "job")
    page.fill("#lookup-form textarea[name=prefix]", str(job["id"]))
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg="160 of 163")
    page.fill("#lookup-form textarea[name=prefix]", "999999")
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg="Look-up failed: job: no job 999999")
    assert page.locator("#lookup-table").is_hidden()
    page.fill("#lookup-form textarea[name=prefix]", "")
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg="give the job id to look up")
    page.select_option("#lookup-form select[name=mode]", "text")
    page.fill("#lookup-form textarea[name=prefix]", "not a prompt anyone ran")
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg="No engine holds a full block of it")
    assert errors == []


def test_staff_look_up_a_users_prefix_and_pin_a_job_on_the_engine_it_ran_on(login, stack):
    job, prompt = completion(stack, "alice")
    page, errors = login(stack, "admin", "admin-pass-123")
    page.fill("#lookup-form textarea[name=prefix]", prompt)
    page.click("#lookup-form button[type=submit]")  # staff: the shared cache, not alice's
    page.wait_for_function(SUMMARY_SAYS, arg="No engine holds a full block of it in the shared")
    page.fill("#lookup-form input[name=user]", "alice")
    page.click("#lookup-form button[type=submit]")
    page.wait_for_function(SUMMARY_SAYS, arg=f"{RAN_ON} holds the longest cached prefix "
                                             "under alice's cache salt")

    page.goto(f"{stack.url}/jobs/{job['id']}/")
    page.click("#pin-job")
    page.wait_for_function("() => !document.querySelector('#pin-answer').hidden")
    assert page.inner_text("#pin-answer").startswith(f"Pinned on {RAN_ON}: 10 blocks"), \
        page.inner_text("#pin-answer")
    [pin] = [a for a in stack.api("GET", "/api/actions/").json()["results"]
             if a["action"] == "pin" and a["params"].get("job") == job["id"]]
    assert pin["engine"] == RAN_ON and pin["ok"], pin
    assert errors == []
