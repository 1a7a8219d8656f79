"""The job and engine pages agree with themselves and with the engine, in headless
Chromium against the real stack (uvicorn, a simulated engine worker with a small pool,
Redis, SQLite): each test is one thing a page once said that was not so (a figure, a
state, a word), driven to the situation that showed it."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "pg"
PROMPT = "Blocks held at the end of a job, shown once it ended. " * 2  # 108 tokens: 6 full blocks
# runs until cancelled (about 40 s; within the pool: 64 blocks of 16 tokens)
LONG = {"max_tokens": 900, "ignore_eos": True}
# the engine page's header: label -> the value shown
HEADER = """() => Object.fromEntries([...document.querySelectorAll('#head-stats .kv')].map(
    (kv) => [kv.querySelector('span').textContent, kv.querySelector('b').textContent]))"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("pages-agree-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=16, num_gpu_blocks=64, num_cpu_blocks=64,
                       max_num_seqs=8, simulate_step_ms=40)
        yield s
    finally:
        s.stop()


def submit(stack, prompt: str, **kw) -> int:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 4,
                                              "engine": ENGINE, **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def story(stack, job_id: int) -> dict:
    r = stack.api("GET", f"/api/jobs/{job_id}/kv/")
    assert r.status_code == 200, r.text
    return r.json()


def act(stack, request_id: str, action: str) -> None:
    r = stack.api("POST", f"/api/engines/{ENGINE}/requests/{request_id}/{action}/")
    assert r.status_code == 200, r.text


def chips(page) -> list[int]:
    return [int(c) for c in page.eval_on_selector_all("#gpu-chips .chip",
                                                      "cs => cs.map((c) => c.textContent)")]


def test_a_paused_engine_makes_no_tokens_per_second(login, stack):
    job_id = submit(stack, "a job running while the engine pauses", **LONG)
    stack.wait_running(job_id)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    page.wait_for_function(f"Number(({HEADER})()['tokens/s'].replaceAll(',', '')) > 0")
    try:
        assert stack.api("POST", f"/api/engines/{ENGINE}/pause/").json()["ok"]
        # the metrics that say paused (sent as the pause is answered) say 0 tokens/s
        metrics = stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]["metrics"]
        assert metrics["state"] == "paused"
        assert (metrics["generation_tokens_per_s"], metrics["prompt_tokens_per_s"]) == (0, 0)
        page.wait_for_function(f"({HEADER})()['tokens/s'] === '0'")
    finally:
        assert stack.api("POST", f"/api/engines/{ENGINE}/resume/").json()["ok"]
        stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    stack.wait_job(job_id)
    assert not errors, errors


def test_a_running_jobs_story_says_it_is_running(login, stack):
    job_id = submit(stack, "a job whose story is read while it runs", **LONG)
    stack.wait_running(job_id)
    page, errors = login(stack, "admin", "admin-pass-123")
    try:
        page.goto(f"{stack.url}/jobs/{job_id}/")
        page.wait_for_function(
            "document.querySelector('#kv-story-when').textContent.includes('running')")
        assert "told no KV story" not in page.inner_text("#kv-story")
    finally:
        stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    stack.wait_job(job_id)
    assert not errors, errors


def test_the_live_pill_goes_when_the_job_ends(login, stack):
    job_id = submit(stack, "a job watched until it is cancelled", **LONG)
    stack.wait_running(job_id)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/jobs/{job_id}/")
    page.wait_for_function("document.querySelector('#conn')?.textContent === 'live'")
    assert stack.api("POST", f"/api/jobs/{job_id}/cancel/").status_code in (200, 202)
    page.wait_for_function("document.querySelector('#status').textContent === 'cancelled'")
    page.wait_for_selector("#conn", state="detached")  # the job stream's end: no longer live
    page.goto(f"{stack.url}/jobs/{job_id}/")  # a page opened on an ended job
    page.wait_for_selector("#kv-story .kv-summary, #kv-story .kv-untold")
    assert page.query_selector("#conn") is None
    assert not errors, errors


def test_a_prompt_shorter_than_a_block_has_no_full_block(login, stack):
    job_id = submit(stack, "seven!!", max_tokens=1)  # 7 tokens (the byte tokenizer)
    assert stack.wait_job(job_id)["num_prompt_tokens"] == 7
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/jobs/{job_id}/")
    page.wait_for_selector("#kv-story .kv-summary")
    text = page.inner_text("#kv-story")
    assert "No full block" in text and "No miss" not in text
    assert page.query_selector("#kv-story .kv-miss.none") is None
    assert "7 prompt tokens in 1 block of 16 tokens" in " ".join(text.split())
    page.wait_for_function("document.querySelector('#out-count').textContent === '1 token'")
    assert not errors, errors


def test_a_finished_jobs_block_table_is_what_it_held_at_its_end(login, stack):
    first = submit(stack, PROMPT)
    stack.wait_job(first)
    hit = submit(stack, PROMPT)  # a prefix hit on the first's blocks
    assert stack.wait_job(hit)["num_cached_tokens"] > 0
    page, errors = login(stack, "admin", "admin-pass-123")
    for job_id in (first, hit):
        final = story(stack, job_id)["final_blocks"]
        assert final and len(final["gpu"]) >= 7, final  # 6 full blocks and the tail
        page.goto(f"{stack.url}/jobs/{job_id}/")
        page.wait_for_selector("#final-blocks")
        assert chips(page) == final["gpu"]
        text = page.inner_text("#blocks")
        assert f"holding {len(final['gpu'])} GPU blocks" in text
        assert "swapped out or waiting" not in text and "Shown while" not in text
        assert page.inner_text("#blocks-when") == "at its end"

    # a page left open while the job runs: the live table, then the record of its end
    job_id = submit(stack, "a job whose blocks are watched to its end", **LONG)
    stack.wait_running(job_id)
    page.goto(f"{stack.url}/jobs/{job_id}/")
    page.wait_for_selector("#gpu-chips .chip")  # its live table, from the engine
    assert stack.api("POST", f"/api/jobs/{job_id}/cancel/").status_code in (200, 202)
    page.wait_for_selector("#final-blocks")
    assert chips(page) == story(stack, job_id)["final_blocks"]["gpu"]
    assert not errors, errors


def test_swaps_are_named_and_counted_alike_everywhere(login, stack):
    job_id = submit(stack, "preempted once, then swapped out and in", **LONG)
    request_id = stack.wait_running(job_id)
    act(stack, request_id, "preempt")
    # (refused while it waits to be admitted again: nothing changes, it is asked again)
    stack.wait(lambda: stack.api("POST", f"/api/engines/{ENGINE}/requests/{request_id}/swap-out/")
               .status_code == 200, "a swap out of the request running again", 20)
    act(stack, request_id, "swap-in")
    page, errors = login(stack, "admin", "admin-pass-123")
    try:
        page.goto(f"{stack.url}/engines/{ENGINE}/")
        page.wait_for_selector(f'.vrow[data-request="{request_id}"]')
        page.wait_for_function(f"({HEADER})()['swaps out/in'] === '1/1'")
        header = page.evaluate(HEADER)
        assert header["preemptions"] == "1"
        row = page.eval_on_selector_all(f'.vrow[data-request="{request_id}"] > div',
                                        "cs => cs.map((c) => c.textContent.trim())")
        assert (row[9], row[10]) == ("1", "1")  # preempt., swaps
        page.goto(f"{stack.url}/jobs/{job_id}/")
        page.wait_for_function("document.querySelectorAll('#kv-story tr[data-kind]').length >= 3")
        kinds = page.eval_on_selector_all("#kv-story tr[data-kind]", "rs => rs.map((r) => r.dataset.kind)")
        assert kinds == ["preemption", "swap-out", "swap-in"]
        assert "an operator swapped it out" in page.inner_text("#kv-story")
        assert "1 preemption (recompute) · swaps out/in 1/1" in page.inner_text("#kv-story")
        facts = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#facts dt')]
            .map((dt) => [dt.textContent, dt.nextElementSibling.textContent]))""")
        assert facts["preemptions"] == "1"
    finally:
        stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    stack.wait_job(job_id)
    assert not errors, errors


def test_an_engine_without_live_requests_says_so_and_its_map_fills_its_panel(login, stack):
    stack.wait(lambda: stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]
               ["metrics"]["running"] == 0, "no request running", 20)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1")
    page.wait_for_selector("#requests .vempty:has-text('No live requests')")
    assert not page.is_visible("#requests .vbody")
    # 64 blocks: cells sized to the blocks, the panel as tall as its map
    sizes = page.evaluate("""() => ({map: document.querySelector('#gpu-map').getBoundingClientRect(),
        wrap: document.querySelector('#gpu-wrap').getBoundingClientRect(),
        panel: document.querySelector('#gpu-wrap').closest('.panel').getBoundingClientRect()})""")
    assert sizes["map"]["height"] >= 0.5 * sizes["panel"]["height"], sizes
    assert sizes["map"]["width"] >= 0.8 * sizes["wrap"]["width"], sizes
    page.select_option("#req-filter", "swapped")
    page.wait_for_selector("#requests .vempty:has-text('No swapped requests.')")
    page.select_option("#req-filter", "all")
    page.wait_for_selector("#requests .vbody", state="visible")  # the ended ones are listed
    assert not errors, errors
