"""Pinning what ran, in headless Chromium against the real stack (uvicorn, a simulated
engine worker, Redis, SQLite): an operator pins a chat job's prefix from the job's page
and from the engine page's selected-request panel, and the operator log folds the pin's
1,500 token ids into a line that expands. The Pin form's modes are unit-tested in
tests/dashboard/js/pin_form.test.mjs; the REST modes in tests/service/test_pin_modes.py."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "pinb"
BLOCK = 16
# a system prompt of 1,500 tokens once the simulator's transcript renders the chat
# ("system: ...\nuser: ...\nassistant: ", a byte a token): the long pin
SYSTEM = ("You are the on-call assistant for the kvops fleet; answer from the runbook. "
          * 20)[:1500 - len("system: \nuser: hi\nassistant: ")]
ANSWER_SAYS = "(what) => document.querySelector('#answer').textContent.includes(what)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("pin-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=BLOCK, num_gpu_blocks=512,
                       num_cpu_blocks=0)
        yield s
    finally:
        s.stop()


def chat_job(stack) -> dict:
    r = stack.api("POST", "/api/jobs/", json={"engine": ENGINE, "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 201, r.text
    job = stack.wait_job(r.json()["id"])
    assert job["status"] == "finished" and job["num_prompt_tokens"] == 1500, job
    return job


def pins_of(stack, job_id: int) -> list[dict]:
    return [a for a in stack.api("GET", "/api/actions/").json()["results"]
            if a["action"] == "pin" and a["params"].get("job") == job_id]


def test_an_operator_pins_a_job_from_its_page_and_the_log_folds_it(login, stack):
    job = chat_job(stack)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/jobs/{job['id']}/")
    page.click("#pin-job")  # (waits until the job's engine is known and the button shows)
    page.wait_for_function("() => !document.querySelector('#pin-answer').hidden")
    full_blocks = 1500 // BLOCK
    assert page.inner_text("#pin-answer") == (
        f"Pinned on {ENGINE}: {full_blocks} blocks ({full_blocks * BLOCK:,} tokens), "
        f"{full_blocks} newly pinned")
    [logged] = pins_of(stack, job["id"])
    assert logged["ok"] and len(logged["params"]["token_ids"]) == 1500

    # 11 more actions: the raw-text pin (refused: a chat job's blocks are its
    # rendered chat's), and evictions
    r = stack.api("POST", f"/api/engines/{ENGINE}/prefix-cache/pin/", json={"text": SYSTEM})
    assert r.status_code == 409, r.text
    for _ in range(10):
        assert stack.api("POST", f"/api/engines/{ENGINE}/prefix-cache/evict/",
                         json={}).status_code == 200

    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{stack.url}/actions/?engine={ENGINE}")
    rows = page.locator("#actions-log tbody tr")
    assert rows.count() == 12
    assert page.evaluate("document.documentElement.scrollHeight") < 1500
    pin_row = rows.filter(has_text="1,500 ids")
    assert pin_row.count() == 1
    assert pin_row.bounding_box()["height"] < 150
    answer = pin_row.locator("td.answer-cell")
    assert answer.bounding_box()["width"] >= 200
    assert f"num_newly_pinned: {full_blocks}" in answer.inner_text()
    # the token list folded to its length and first ids; expanded, every id
    ids = pin_row.locator("td.params details", has_text="1,500 ids")
    assert ids.locator("pre").is_hidden()
    ids.locator("summary").click()
    shown = ids.locator("pre")
    assert shown.is_visible()
    assert [int(t) for t in shown.inner_text().strip("[]").split(",")] == \
        logged["params"]["token_ids"]
    # the refused raw-text pin: its long text cut, its answer the engine's refusal
    text_row = rows.filter(has_text="PrefixNotCachedError")
    assert text_row.bounding_box()["height"] < 150
    assert SYSTEM not in text_row.locator("td.params summary").inner_text()
    assert not errors, errors


def test_an_operator_pins_a_job_from_the_engine_pages_request_panel(login, stack):
    job = chat_job(stack)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/?request={job['request_id']}")
    page.click("#pin-job")  # the selected request's panel, once the request shows
    page.wait_for_function(ANSWER_SAYS, arg="HTTP 200")
    assert f'"num_tokens": {1500 // BLOCK * BLOCK}' in page.inner_text("#answer")
    assert len(pins_of(stack, job["id"])) == 1
    assert not errors, errors


def test_a_plain_user_gets_no_pin_button(login, stack):
    r = stack.api("POST", "/api/jobs/", user="alice", json={"prompt": "x" * 40, "max_tokens": 1})
    job = stack.wait_job(r.json()["id"], user="alice")
    page, errors = login(stack, "alice", "alice-pass-123")
    page.goto(f"{stack.url}/jobs/{job['id']}/")
    page.wait_for_function("document.querySelector('#facts').textContent.includes('owner')")
    assert page.locator("#pin-job").count() == 0
    assert not errors, errors
