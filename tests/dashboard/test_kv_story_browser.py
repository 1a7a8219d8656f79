"""A job's KV story in headless Chromium against the real stack (uvicorn, a simulated
engine worker with a small pool, Redis, SQLite): a prompt run, run again (a full hit),
pushed out of the pool by a flood of unrelated prompts and run once more (its first miss:
evicted, by one of the flood's requests). The job page draws each story, its first miss
links to the engine page at that moment of the timeline with the evicting request
selected, and the engine page's misses-by-reason panel agrees with the engine's counters.
tests/service/test_kv_story.py drives the same scenario through the API alone."""
import json
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "kvs"
PROMPT = "The story of prompt one, told twice. " * 5  # 185 tokens: 11 full blocks and 9 tokens
# static/kvops/colors.js SOURCE_CSS, as the browser computes them
SOURCE_RGB = {"gpu": "rgb(29, 138, 78)", "cpu": "rgb(138, 92, 214)", "computed": "rgb(227, 163, 59)"}
# the cells of the job page's strip, in order
CELLS = """() => [...document.querySelectorAll('#kv-story .kv-strip .kv-cell')].map((c) => ({
    block: Number(c.dataset.block), classes: [...c.classList],
    colour: getComputedStyle(c).backgroundColor}))"""
# the engine page's misses-by-reason bars, in order: [[reason, tokens], ...]
BARS = """() => [...document.querySelectorAll('#misses .bar-row')].map(
    (r) => [r.dataset.reason, Number(r.dataset.tokens)])"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("kv-story-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=16, num_gpu_blocks=64, num_cpu_blocks=0,
                       max_num_seqs=8, simulate_step_ms=5)
        yield s
    finally:
        s.stop()


def run(stack, prompt: str, **kw) -> dict:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 4,
                                              "engine": ENGINE, **kw})
    assert r.status_code == 201, r.text
    return stack.wait_job(r.json()["id"])


def story(stack, job_id: int) -> dict:
    r = stack.api("GET", f"/api/jobs/{job_id}/kv/")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def scenario(stack):
    """The prompt's three runs and the flood between the second and the third, with
    their stories as the API tells them."""
    first = run(stack, PROMPT)
    hit = run(stack, PROMPT)
    flood = [run(stack, f"flood {i}: " + "unrelated words fill the pool " * 8) for i in range(6)]
    evicted = run(stack, PROMPT)
    out = {"first": story(stack, first["id"]), "hit": story(stack, hit["id"]),
           "evicted": story(stack, evicted["id"]), "flood": flood}
    # what the scenario is to produce, as tests/service/test_kv_story.py checks it
    assert [b["source"] for b in out["hit"]["blocks"]] == ["gpu"] * 11 + ["computed"]
    assert out["hit"]["first_miss"] is None
    miss = out["evicted"]["first_miss"]
    assert miss["reason"] == "evicted" and miss["at"], miss
    assert miss["by"] in {j["request_id"] for j in flood}, miss
    return out


def expected_misses(stack) -> dict:
    """Prompt tokens computed at first admission, by the first miss's reason, summed over
    the stories of every job the engine ran (a full hit's: "partial_block"), as the
    engine counts them (engine/observe/story.py StoryBook.admitted)."""
    jobs = stack.api("GET", f"/api/jobs/?engine={ENGINE}&limit=1000").json()["results"]
    totals: dict = {}
    for job in jobs:
        told = story(stack, job["id"])
        if not told["told"]:
            continue
        reason = told["first_miss"]["reason"] if told["first_miss"] else "partial_block"
        computed = told["prompt_tokens"] - sum(told["cached_tokens"].values())
        totals[reason] = totals.get(reason, 0) + computed
    return {k: v for k, v in totals.items() if v}


def json_array(pairs) -> str:
    """[[reason, tokens], ...] as a JavaScript string literal of its JSON."""
    return json.dumps(json.dumps([list(p) for p in pairs], separators=(",", ":")))


def open_job(page, stack, doc: dict) -> list[dict]:
    """The job page of the story `doc`, once its strip shows; returns its cells."""
    page.goto(f"{stack.url}/jobs/{doc['job']}/")
    page.wait_for_function("document.querySelectorAll('#kv-story .kv-cell').length > 0")
    return page.evaluate(CELLS)


def assert_cells_match(cells: list[dict], doc: dict) -> None:
    assert [c["block"] for c in cells] == [b["index"] for b in doc["blocks"]]
    for cell, block in zip(cells, doc["blocks"]):
        assert f"src-{block['source']}" in cell["classes"], (cell, block)
        assert cell["colour"] == SOURCE_RGB[block["source"]], (cell, block)


def test_the_job_page_draws_a_full_hit_and_an_evicted_prompt(login, stack, scenario):
    page, errors = login(stack, "admin", "admin-pass-123")
    hit = scenario["hit"]
    cells = open_job(page, stack, hit)
    assert len(cells) == 12  # 11 full blocks and the partly filled one
    assert_cells_match(cells, hit)
    assert not any("first-miss" in c["classes"] for c in cells)
    assert page.locator("#kv-story .kv-miss.none").count() == 1
    assert "GPU 176 · CPU 0 · disk 0" in page.inner_text("#kv-story .kv-cached")

    evicted = scenario["evicted"]
    miss = evicted["first_miss"]
    cells = open_job(page, stack, evicted)
    assert_cells_match(cells, evicted)
    assert [c["block"] for c in cells if "first-miss" in c["classes"]] == [miss["block"]]
    assert cells[miss["block"]]["colour"] == SOURCE_RGB["computed"]
    box = page.locator('#kv-story .kv-miss[data-reason="evicted"]')
    assert box.get_attribute("data-block") == str(miss["block"])
    text = box.inner_text()
    assert miss["detail"] in text and f"to make room for {miss['by']}" in text
    assert "its block was taken for another request's new blocks" in text  # the reason in words
    cached = evicted["cached_tokens"]
    assert f"GPU {cached['gpu']} · CPU {cached['cpu']} · disk {cached['disk']}" in \
        page.inner_text("#kv-story .kv-cached")
    href = box.locator("a.moment").get_attribute("href")
    url = urlparse(href)
    assert url.path == f"/engines/{ENGINE}/"
    assert parse_qs(url.query) == {"request": [miss["by"]], "at": [miss["at"]]}, href
    assert page.locator("#kv-story .kv-untold").count() == 0
    assert not errors, errors


def test_the_first_miss_opens_the_engine_page_at_that_moment(login, stack, scenario):
    """The link opens the engine's timeline at the first state stored at or after the
    eviction (the end of the step that evicted), not live, with the flood request that
    took the block selected and its own story shown."""
    page, errors = login(stack, "admin", "admin-pass-123")
    miss = scenario["evicted"]["first_miss"]
    at = datetime.fromisoformat(miss["at"]).timestamp()
    by = miss["by"]
    open_job(page, stack, scenario["evicted"])
    page.click("#kv-story .kv-miss a.moment")
    page.wait_for_url(f"**/engines/{ENGINE}/?*")
    try:
        page.wait_for_function("""([at, by]) => { const s = window.kvops && kvops.state();
            if (!s || !kvops.scrubbing() || kvops.timeline.loading || s === kvops.live()) return false;
            const r = s.requestById(by);
            return s.ts >= at && r && kvops.selected() === r.index; }""", arg=[at, by])
    except playwright.TimeoutError:
        raise AssertionError(f"not at {at} with {by} selected: " + page.evaluate("""(by) => {
            const s = window.kvops && kvops.state();
            return JSON.stringify(s && {ts: s.ts, scrubbing: kvops.scrubbing(), live: s === kvops.live(),
                request: Boolean(s.requestById(by)), selected: kvops.selected(),
                label: kvops.timeline.atLabel.textContent}); }""", by)) from None
    shown = page.evaluate("""(by) => { const s = kvops.state(), r = s.requestById(by);
        return {ts: s.ts, want: kvops.timeline.want, status: r.status, label: kvops.timeline.atLabel.textContent,
                liveTs: kvops.live() && kvops.live().ts}; }""", by)
    # the state stored at the end of the eviction's step: within a capture interval of it
    assert at <= shown["ts"] <= at + 1.0, (at, shown)
    assert abs(shown["ts"] - shown["want"]) < 1e-6, shown
    assert shown["label"] != "live" and "−" in shown["label"], shown
    assert shown["liveTs"] is None or shown["liveTs"] > shown["ts"] + 1, shown
    page.wait_for_selector(f'.vrow.selected[data-request="{by}"]')
    assert by in page.inner_text("#selected")
    # the evicting request's own story: a flood prompt nobody had cached
    job = by.split("-")[1]
    page.wait_for_selector('#selected-story .kv-miss[data-reason="never_cached"]')
    compact = page.inner_text("#selected-story")
    assert f"job {job}" in compact and "preemptions: 0" in compact, compact
    assert page.locator("#selected-story .kv-cell").count() == len(story(stack, int(job))["blocks"])
    assert not errors, errors


def test_the_misses_by_reason_panel_agrees_with_the_engines_counters(login, stack, scenario):
    want = expected_misses(stack)
    assert {"evicted", "never_cached"} <= set(want), want
    api_missed = {}

    def api_agrees() -> bool:
        metrics = stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]["metrics"]
        api_missed.clear()
        api_missed.update({k: v for k, v in metrics["missed_tokens_by_reason"].items() if v})
        return api_missed == want

    stack.wait(api_agrees, f"the engine's heartbeat counting {want}", 30)
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    # the engine started with this module: every sample since is in the panel's span, so
    # the counters' growth over it is their whole count; the bars come largest first
    bars = sorted(want.items(), key=lambda kv: (-kv[1], kv[0]))
    try:
        page.wait_for_function(f"""() => JSON.stringify(({BARS})()) === {json_array(bars)}""")
    except playwright.TimeoutError:
        raise AssertionError(f"bars {page.evaluate(BARS)}, want {bars}") from None
    assert [list(b) for b in bars] == page.evaluate(BARS)
    assert page.inner_text("#misses-span")  # says which span it counts over
    evicted = page.inner_text('#misses .bar-row[data-reason="evicted"]')
    assert "its block was taken for another request's new blocks" in evicted
    assert f"{want['evicted']:,}" in evicted
    widths = page.evaluate("""() => [...document.querySelectorAll('#misses .bar > span')]
        .map((s) => s.getBoundingClientRect().width)""")
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0], widths
    assert not errors, errors


def test_the_job_page_reads_the_story_again_when_the_job_ends(login, stack):
    """Told at admission and read while the job runs (the engine paused meanwhile, so
    that it still runs when the page reads it); the engine resumes, the job ends, and
    the page reads the whole story again by itself."""
    page, errors = login(stack, "admin", "admin-pass-123")
    r = stack.api("POST", "/api/jobs/", json={"prompt": "a job followed to its end " * 4,
                                              "max_tokens": 600, "ignore_eos": True,
                                              "engine": ENGINE})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    try:
        stack.wait_running(job_id)
        assert stack.api("POST", f"/api/engines/{ENGINE}/pause/").status_code == 200
        stack.wait(lambda: story(stack, job_id)["told"], "its story told", 15)
        page.goto(f"{stack.url}/jobs/{job_id}/")
        page.wait_for_function("document.querySelectorAll('#kv-story .kv-cell').length > 0")
        assert "ended" not in page.inner_text("#kv-story-when")
        assert story(stack, job_id)["status"] == "running"
    finally:
        assert stack.api("POST", f"/api/engines/{ENGINE}/resume/").status_code == 200
    page.wait_for_function("document.querySelector('#kv-story-when').textContent.includes('has ended')")
    ended = story(stack, job_id)
    assert ended["status"] == "finished" and ended["moments"]["ended"], ended
    assert "ended –" not in page.inner_text("#kv-story dl.facts")
    assert page.locator("#kv-story .kv-cell").count() == len(ended["blocks"])
    assert not errors, errors
