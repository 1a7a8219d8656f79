"""The console an SRE keeps open, in headless Chromium against the real stack (uvicorn, a
simulated engine worker with the default instruct model's tokenizer and chat template,
Redis, SQLite): a hovered block's tooltip (its holders, their tokens and text for their
owner only, its idle time and place in the eviction order), the submit forms' chat mode
and the hint for a completion that ended at once, and the overview card's labels. The
tooltip's lines are unit-tested in tests/dashboard/js/block_tip.test.mjs, the engine's
answer in tests/engine/test_block_facts.py."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "inst"
BLOCK = 16
SHARED = ("The console an SRE keeps open shows every block of the cache, who holds it and "
          "what it holds, so that a page at three in the morning is answered from one screen.")
TIP_SAYS = "(what) => document.querySelector('#tooltip').textContent.includes(what)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from engine.model.default_model import default_model_dir
    folder = default_model_dir()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("default model not converted (run `make setup`)")
    s = Stack(Path(tmp_path_factory.mktemp("console-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, simulate_tokenizer=str(folder), block_size=BLOCK,
                       num_gpu_blocks=256, num_cpu_blocks=0, simulate_step_ms=20)
        yield s
    finally:
        s.stop()


def submit(stack, user: str, **body) -> dict:
    r = stack.api("POST", "/api/jobs/", user=user, json={"engine": ENGINE, **body})
    assert r.status_code == 201, r.text
    return r.json()


def running(stack, job: dict, user: str) -> dict:
    """The job once its request runs (it has an id and blocks)."""
    stack.wait(lambda: stack.api("GET", f"/api/jobs/{job['id']}/", user=user).json()
               ["status"] == "running", f"job {job['id']} to run", 30)
    return stack.api("GET", f"/api/jobs/{job['id']}/", user=user).json()


def hover_block(page, request_id: str, position: int) -> int:
    """Rest the mouse on the block at `position` of the request's GPU table; its id."""
    page.wait_for_function("(rid) => { const r = kvops.state()?.requestById(rid); "
                           "return r && r.block_table.length > 1; }", arg=request_id)
    page.locator("#gpu-map").scroll_into_view_if_needed()
    page.mouse.move(0, 0)  # (leave the last block, so that the next is a new hover)
    block, x, y = page.evaluate("""([rid, k]) => {
        const m = kvops.gpuMap, id = kvops.state().requestById(rid).block_table[k];
        const box = m.canvas.getBoundingClientRect(), [x, y] = m.center(id);
        return [id, box.left + x, box.top + y]; }""", [request_id, position])
    page.mouse.move(x, y)
    return block


def test_a_hovered_block_says_who_holds_what_and_when_it_goes(login, stack):
    cached = submit(stack, "admin", prompt="A finished job leaves its prompt's blocks cached "
                    "for the next request with the same prefix, until they are evicted.",
                    max_tokens=1)
    assert stack.wait_job(cached["id"])["status"] == "finished"
    first = running(stack, submit(stack, "alice", prompt=SHARED, max_tokens=3000), "alice")
    second = running(stack, submit(stack, "alice", prompt=SHARED, max_tokens=3000), "alice")
    staff = running(stack, submit(stack, "admin", prompt="An operator's own long job: " * 6,
                                  max_tokens=3000), "admin")
    try:
        page, errors = login(stack, "alice", "alice-pass-123")
        page.goto(f"{stack.url}/engines/{ENGINE}/")
        # her two jobs share their prompt's first block: both holders, its tokens, its text
        hover_block(page, first["request_id"], 0)
        page.wait_for_function(TIP_SAYS, arg="in use now")
        tip = page.inner_text("#tooltip")
        assert "ref count 2 (shared ×2)" in tip
        for job in (first, second):
            assert f"held by {job['request_id']} (job {job['id']}): tokens 0–15" in tip
        assert "“The console an SRE keeps open" in tip
        assert "to be evicted" not in tip
        # an operator's request: another user's, its tokens but not their text
        hover_block(page, staff["request_id"], 1)
        page.wait_for_function(TIP_SAYS, arg="in use now")
        tip = page.inner_text("#tooltip")
        assert f"held by {staff['request_id']} (another user's request): tokens 16–31" in tip
        assert "“" not in tip
        # a cached block: the prefix cache holds it; how long ago it was used, its turn
        block = page.evaluate("() => { const s = kvops.state(); "
                              "return s.gpu.state.findIndex((v) => s.blockStates[v] === 'cached'); }")
        assert block >= 0
        page.mouse.move(0, 0)
        x, y = page.evaluate("""(id) => { const m = kvops.gpuMap, box = m.canvas.getBoundingClientRect();
            const [x, y] = m.center(id); return [box.left + x, box.top + y]; }""", block)
        page.mouse.move(x, y)
        page.wait_for_function(TIP_SAYS, arg="to be evicted of")
        tip = page.inner_text("#tooltip")
        assert f"GPU block {block} · cached" in tip and "held by the prefix cache" in tip
        assert "last used " in tip and " ago" in tip
        assert page.inner_text("#tooltip").count("“") == 0
        assert not errors, errors

        # staff read every holder's text
        page, errors = login(stack, "admin", "admin-pass-123")
        page.goto(f"{stack.url}/engines/{ENGINE}/")
        hover_block(page, first["request_id"], 0)
        page.wait_for_function(TIP_SAYS, arg="in use now")
        assert "“The console an SRE keeps open" in page.inner_text("#tooltip")
        # the selected request's chips mark a shared block by its count
        page.goto(f"{stack.url}/engines/{ENGINE}/?request={first['request_id']}")
        page.wait_for_selector("#selected-detail .chip .chip-shared")
        assert page.inner_text("#selected-detail .chip .chip-shared") == "×2"
        assert not errors, errors
    finally:
        for job, user in ((first, "alice"), (second, "alice"), (staff, "admin")):
            stack.api("POST", f"/api/jobs/{job['id']}/cancel/", user=user)


def first_token(stack, prompt: str) -> int:
    job = stack.wait_job(submit(stack, "alice", prompt=prompt, max_tokens=1)["id"],
                         user="alice")
    return job["output_token_ids"][0]


def test_the_forms_default_to_chat_and_a_completion_that_ended_at_once_says_why(login, stack):
    page, errors = login(stack, "alice", "alice-pass-123")
    page.goto(f"{stack.url}/jobs/")
    assert page.is_checked("input[name=mode][value=chat]")
    assert page.is_visible("#chat-box") and page.is_hidden("#prompt-box")
    page.check("input[name=mode][value=prompt]")  # completion stays selectable
    assert page.is_visible("#prompt-box") and page.is_hidden("#chat-box")
    page.check("input[name=mode][value=chat]")
    page.fill(".chat-row:nth-child(2) textarea", "Which blocks are shared?")
    page.click("#submit button[type=submit]")
    page.wait_for_url("**/jobs/*/")
    assert "user: Which blocks are shared?" in page.inner_text("body")

    # A completion the model ends at once (the simulator stops on the token it makes first)
    prompt = "Write a haiku about paged attention."
    job = submit(stack, "alice", prompt=prompt, max_tokens=50,
                 stop_token_ids=[first_token(stack, prompt)])
    ended = stack.wait_job(job["id"], user="alice")
    assert ended["finish_reason"] == "stop" and ended["num_output_tokens"] <= 1, ended
    page.goto(f"{stack.url}/jobs/{job['id']}/")
    page.wait_for_selector("#chat-hint:not([hidden])")
    assert "The model ended at once: an instruct model usually needs chat mode" in \
        page.inner_text("#chat-hint")
    page.click("#as-chat")
    page.wait_for_url(lambda url: url.rstrip("/").split("/")[-1] not in ("", str(job["id"]))
                      and "/jobs/" in url)
    again = int(page.url.rstrip("/").split("/")[-1])
    resubmitted = stack.api("GET", f"/api/jobs/{again}/", user="alice").json()
    assert resubmitted["messages"] == [{"role": "user", "content": prompt}]
    assert resubmitted["params"]["max_tokens"] == 50 and resubmitted["requested_engine"] == ENGINE
    # a job that made its tokens gets no hint
    page.goto(f"{stack.url}/jobs/{stack.wait_job(again, user='alice')['id']}/")
    page.wait_for_function("document.querySelector('#facts').textContent.includes('finish reason')")
    assert page.is_hidden("#chat-hint")
    assert not errors, errors


def test_the_overview_card_labels_its_sparkline_and_pool_and_its_form_offers_chat(login, stack):
    stack.wait_job(submit(stack, "admin", prompt="warm the sparkline " * 4, max_tokens=100)["id"])
    page, errors = login(stack, "admin", "admin-pass-123")
    card = f".card[data-engine={ENGINE}]"
    # a simulated engine's pool is no GPU's
    assert page.inner_text(f"{card} [data-f=pool]") == f"256 KV blocks of {BLOCK} tokens"
    page.wait_for_function("(c) => document.querySelector(c + ' [data-f=spark-label]')"
                           ".textContent.includes('· max')", arg=card)
    label = page.inner_text(f"{card} [data-f=spark-label]")
    assert label.startswith("generated tokens/s, last ") and float(label.split("max ")[1]) > 0
    assert page.is_checked("#quick-submit input[name=mode][value=chat]")
    page.fill("#quick-submit textarea[name=prompt]", "Is the cache warm?")
    page.click("#quick-submit button[type=submit]")
    page.wait_for_function("document.querySelector('#quick-result').textContent.includes('queued')")
    job_id = int(page.inner_text("#quick-result a"))
    job = stack.api("GET", f"/api/jobs/{job_id}/").json()
    assert job["messages"] == [{"role": "user", "content": "Is the cache warm?"}]
    assert not errors, errors
