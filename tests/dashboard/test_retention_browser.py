"""The engine page's Retention control, in headless Chromium against the real stack
(uvicorn, a simulated engine worker, Redis, SQLite): an operator sets the eviction
policy and the pin budget and the engine reports them; a pin past the new budget is
refused and the page says why. A plain user gets no control. static/kvops/retention.js
is unit-tested in tests/dashboard/js/retention.test.mjs."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "ret"
# the byte tokenizer: a character is a token; 40 tokens are 10 blocks of 4, more than
# a budget of 10% of 64 blocks (6) lets a pin hold
PROMPT = "a system prompt of forty characters, ok!"
assert len(PROMPT) == 40
# the engine page's answer panel once its text says `what` (a string argument)
ANSWER_SAYS = "(what) => document.querySelector('#answer').textContent.includes(what)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("retention-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
        yield s
    finally:
        s.stop()


def metrics(stack) -> dict:
    engines = stack.api("GET", "/api/engines/").json()
    return next(e for e in engines if e["name"] == ENGINE)["metrics"]


def test_an_operator_sets_the_policy_and_the_pin_budget(login, stack):
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    # the engine's own values, from its live metrics: lru, half the pool
    page.wait_for_function("""() => document.querySelector('#retention-pinned').textContent
        === '0 of 32 blocks pinned (budget 50%)'""")
    assert page.input_value("#retention-policy") == "lru"
    assert page.input_value("#retention-budget") == "50"
    assert page.locator("#retention-policy option").all_inner_texts() == [
        "lru: least recently used first", "slru: blocks never hit before blocks hit",
        "lfu: least hit first", "priority: prefixes of the least important requests first"]

    page.select_option("#retention-policy", "slru")
    page.fill("#retention-budget", "10")
    page.click("#retention-apply")
    page.wait_for_function(ANSWER_SAYS, arg="HTTP 200")
    assert page.inner_text("#answer").startswith(
        "Retention: slru (blocks never hit before blocks hit), 0 of 6 blocks pinned (budget 10%)")
    stack.wait(lambda: metrics(stack)["eviction_policy"] == "slru"
               and metrics(stack)["pin_budget"] == 0.1, "the engine reporting slru and 10%", 30)
    page.wait_for_function("""() => document.querySelector('#retention-pinned').textContent
        === '0 of 6 blocks pinned (budget 10%)'""")

    # a pin of 10 blocks is past the budget of 6: the Pin control shows why it was refused
    r = stack.api("POST", "/api/jobs/", json={"prompt": PROMPT, "max_tokens": 4, "engine": ENGINE})
    assert r.status_code == 201, r.text
    assert stack.wait_job(r.json()["id"])["status"] == "finished"
    page.select_option("#pin-mode", "text")  # (a completion job's prompt: raw text)
    page.fill("#pin-prompt", PROMPT)
    page.click("#pin")
    page.wait_for_function(ANSWER_SAYS, arg="HTTP 409")
    assert "over the pin budget of 6 blocks" in page.inner_text("#answer")
    assert not errors, errors


def test_a_plain_user_gets_no_retention_control(login, stack):
    page, errors = login(stack, "alice", "alice-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    page.wait_for_function("document.querySelector('#conn').textContent === 'live'")
    assert page.locator("#retention-controls, #retention-apply").count() == 0
    assert not errors, errors
