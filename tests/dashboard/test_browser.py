"""The dashboard end to end, in headless Chromium against the real stack (uvicorn, a
simulated engine worker, Redis, SQLite): log in, submit a job, watch its tokens and its
blocks, preempt and swap it out from the engine page, and see a non-operator get no
buttons and a 403. Screenshots go to artifacts/dashboard/ (looked at, not compared)."""
import json
from pathlib import Path

import pytest

from tests.support.stack import Stack

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard"
FREE_RGB = [0xE9, 0xEC, 0xF1]  # static/kvops/colors.js CSS.free


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("browser-stack")))
    try:
        s.start_web()
        s.start_engine("sim", simulate=1, vocab_size=32000, num_gpu_blocks=768,
                       num_cpu_blocks=256, block_size=16, max_num_seqs=16, simulate_step_ms=25)
        yield s
    finally:
        s.stop()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def block_pixel(page, request_id: str, pool: str):
    """The colour of the first block of the request's table on a map (None: no block)."""
    return page.evaluate("""([rid, pool]) => {
        const s = kvops.state(); const r = s && s.requestById(rid);
        const table = r && (pool === "gpu" ? r.block_table : r.cpu_block_table);
        if (!table || !table.length) return null;
        const map = pool === "gpu" ? kvops.gpuMap : kvops.cpuMap;
        const id = table[0];
        const x = (id % map.cols) * map.cell, y = Math.floor(id / map.cols) * map.cell;
        return Array.from(map.ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
    }""", [request_id, pool])


def row_field(page, request_id: str, column: int) -> str:
    return page.inner_text(f'.vrow[data-request="{request_id}"] > div:nth-child({column})')


def operator_action(page, request_id: str, action: str) -> None:
    page.click(f'.vrow[data-request="{request_id}"] button[data-action="{action}"]')
    page.click("#confirm-ok")
    page.wait_for_function("document.querySelector('#answer').textContent.includes('HTTP 200')")
    page.wait_for_function(
        "([a, r]) => [...document.querySelectorAll('#actions td')].some("
        "td => td.textContent.includes(a) && td.textContent.includes(r))", arg=[action, request_id])


def test_dashboard_end_to_end(login, stack):
    page, errors = login(stack, "admin", "admin-pass-123")
    page.wait_for_function("document.querySelector('.card[data-engine=sim] [data-f=status]')"
                           ".textContent === 'ready'")
    shot(page, "overview")

    # Submit a job from the jobs page and watch its tokens stream in.
    page.goto(f"{stack.url}/jobs/")
    page.fill("textarea[name=prompt]", "Tell the story of paged attention. " * 4)
    page.fill("input[name=max_tokens]", "3000")
    page.click("#submit button[type=submit]")
    page.wait_for_url("**/jobs/*/")
    page.wait_for_function("document.querySelector('#output').textContent.length > 20")
    first = len(page.inner_text("#output"))
    page.wait_for_function(f"document.querySelector('#output').textContent.length > {first + 20}")
    page.wait_for_selector("#gpu-chips .chip")  # its block table, from the engine
    request_id = page.inner_text("#facts dd:nth-of-type(4)")
    assert request_id.startswith("job-")
    shot(page, "job-page")

    # The engine page: the request and its blocks on the map.
    page.goto(f"{stack.url}/engines/sim/?request={request_id}")
    page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1 && kvopsPerf.deltas >= 5")
    page.wait_for_selector(f'.vrow.selected[data-request="{request_id}"]')
    assert row_field(page, request_id, 4) == "running"
    pixel = block_pixel(page, request_id, "gpu")
    assert pixel is not None and pixel != FREE_RGB  # painted in its owner's colour
    page.hover("#gpu-map", position={"x": 3, "y": 3})
    assert "GPU block 0" in page.inner_text("#tooltip")
    shot(page, "engine-page")

    # Preempt: the engine answers, the table counts it, the log and the events show it.
    operator_action(page, request_id, "preempt")
    page.wait_for_function(
        f"document.querySelector('.vrow[data-request=\"{request_id}\"] > div:nth-child(10)')"
        ".textContent.trim() === '1'")
    page.wait_for_selector(f'#events .ev:has-text("Preempted"):has-text("{request_id}")')

    # Swap out: its blocks leave the GPU map for the CPU pool.
    page.wait_for_function(f"""() => {{ const r = kvops.state().requestById("{request_id}");
        return r && r.status === "running" && r.block_table.length > 0; }}""")
    operator_action(page, request_id, "swap-out")
    page.wait_for_function(f"""() => {{ const r = kvops.state().requestById("{request_id}");
        return r && r.status === "swapped" && r.block_table.length === 0
               && r.cpu_block_table.length > 0; }}""")
    assert row_field(page, request_id, 4).startswith("swapped")
    assert block_pixel(page, request_id, "cpu") not in (None, FREE_RGB)
    page.wait_for_selector(f'#events .ev:has-text("SwappedOut"):has-text("{request_id}")')
    shot(page, "engine-page-swapped")
    perf = json.loads(page.evaluate("JSON.stringify({n: kvopsPerf.deltas, "
                                    "resyncs: kvopsPerf.resyncs, apply: kvopsPerf.applyMs})"))
    # Live deltas were applied (how fast is bench_browser's to say: no timing in tests).
    assert perf["n"] > 10 and len(perf["apply"]) > 0, perf

    page.goto(f"{stack.url}/actions/")
    log = page.inner_text("#actions-log")
    assert "swap-out" in log and "preempt" in log and request_id in log
    assert not errors, errors

    # A user who is not an operator: no buttons, and the API refuses.
    alice, alice_errors = login(stack, "alice", "alice-pass-123")
    alice.goto(f"{stack.url}/engines/sim/")
    alice.wait_for_selector(f'.vrow[data-request="{request_id}"]')
    assert alice.locator(".vrow button").count() == 0
    assert alice.locator("#prefix-controls").count() == 0
    status = alice.evaluate("""async (rid) => {
        const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
        const r = await fetch(`/api/engines/sim/requests/${rid}/swap-in/`, {method: "POST",
            headers: {"X-CSRFToken": token, "Content-Type": "application/json"}, body: "{}"});
        return r.status; }""", request_id)
    assert status == 403
    shot(alice, "engine-page-viewer")
    assert not alice_errors, alice_errors
    page.goto(f"{stack.url}/engines/sim/?request={request_id}")
    page.wait_for_selector(f'.vrow[data-request="{request_id}"] button[data-action="abort"]')
    operator_action(page, request_id, "abort")  # leave the engine idle


def test_the_job_page_shows_every_sample_of_a_forked_job(login, stack):
    """n > 1: the page follows sample 0 live and, once the job has ended, lists every
    sample with its finish reason (from the socket, then on a fresh load from the row)."""
    page, errors = login(stack, "admin", "admin-pass-123")
    job_id = stack.api("POST", "/api/jobs/", json={"prompt": "three ways", "max_tokens": 40,
                                                    "n": 3, "ignore_eos": True}).json()["id"]
    page.goto(f"{stack.url}/jobs/{job_id}/")
    page.wait_for_function("document.querySelectorAll('#samples .sample').length === 3")
    texts = page.eval_on_selector_all("#samples .sample", "els => els.map(e => e.textContent)")
    job = stack.wait_job(job_id)
    assert [t.split(" ", 2)[2] for t in texts] == [s["text"] for s in job["samples"]]
    assert all("length" in t for t in texts)
    page.reload()
    assert len(page.query_selector_all("#samples .sample")) == 3
    assert not errors


def test_the_engine_page_keeps_a_forks_samples_together(login, stack):
    """n > 1 on the engine page: the samples are rows next to each other, in order,
    marked as samples; their shared blocks carry ref count 3 in the snapshot; the log
    shows the fork."""
    page, errors = login(stack, "admin", "admin-pass-123")
    job_id = stack.api("POST", "/api/jobs/", json={
        "prompt": "a long forked story " * 6, "max_tokens": 3000, "n": 3,
        "ignore_eos": True}).json()["id"]
    stack.wait(lambda: stack.api("GET", f"/api/jobs/{job_id}/").json()["status"] == "running",
               "the job running", 30)
    parent = stack.api("GET", f"/api/jobs/{job_id}/").json()["request_id"]
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1")
    page.fill("#req-search", parent)
    page.wait_for_selector(f'.vrow.sample[data-request="{parent}/2"]')
    order = page.evaluate("""(parent) => [...document.querySelectorAll('.vrow')]
        .sort((a, b) => parseFloat(a.style.top) - parseFloat(b.style.top))
        .map(e => e.dataset.request).filter(r => r.startsWith(parent))""", parent)
    assert order == [f"{parent}/{i}" for i in range(3)], order
    shared = page.evaluate("""(parent) => { const s = kvops.state();
        const a = s.requestById(parent + "/0"), b = s.requestById(parent + "/1");
        return a.block_table.filter(id => b.block_table.includes(id)).length; }""", parent)
    assert shared >= 1  # the prompt's full blocks, held by every sample
    page.wait_for_selector(f'#events .ev:has-text("Forked"):has-text("{parent}")')
    stack.api("POST", f"/api/jobs/{job_id}/cancel/")
    assert not errors, errors


def test_pause_and_resume_from_the_engine_page(login, stack):
    """An operator pauses the engine from its page: the header and the overview card say
    paused, a running job's tokens stop (its request keeps its blocks), the API and the
    action log show it; resume, and the tokens flow again. The header follows the answer
    at once, not the deltas sent before the engine paused."""
    page, errors = login(stack, "admin", "admin-pass-123")
    job = page.evaluate("""async () => {
        const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
        const r = await fetch("/api/jobs/", {method: "POST", headers: {"X-CSRFToken": token,
            "Content-Type": "application/json"},
            body: JSON.stringify({prompt: "pause me " .repeat(8), max_tokens: 4000, engine: "sim"})});
        return (await r.json()).id; }""")
    try:
        page.goto(f"{stack.url}/engines/sim/")
        page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1")
        page.wait_for_function(f"""() => kvops.state() && [...kvops.state().requests.values()].some(
            r => r.job_id === "{job}" && r.status === "running" && r.num_output_tokens > 3)""")
        page.click("#pause-toggle")
        page.click("#confirm-ok")
        page.wait_for_function("document.querySelector('#engine-status').textContent === 'paused'")
        assert page.inner_text("#pause-toggle") == "Resume"
        page.wait_for_function("document.querySelector('#answer').textContent.includes('HTTP 200')")

        def outputs() -> int:
            return page.evaluate(f"""() => [...kvops.state().requests.values()].find(
                r => r.job_id === "{job}").num_output_tokens""")

        api = page.evaluate("""async () => (await (await fetch("/api/engines/sim/")).json())""")
        held = page.evaluate(f"""() => [...kvops.state().requests.values()].find(
            r => r.job_id === "{job}").block_table.length""")
        assert held > 0  # paused, its request keeps its blocks
        # The API says paused; once a delta from the engine says so too, the page has every
        # delta of the steps before the pause (they come in order). The engine steps no
        # more: the count the page shows stays put while the overview loads and shows it.
        page.wait_for_function("""async () => (await (await fetch("/api/engines/sim/")).json())
            .engine.state === "paused" """, polling=200)
        page.wait_for_function("kvopsPerf.engineState === 'paused'")
        stopped_at = outputs()
        overview = page.context.new_page()
        overview.goto(f"{stack.url}/")
        overview.wait_for_function("document.querySelector('.card[data-engine=sim] [data-f=status]')"
                                   ".textContent === 'paused'")
        overview.close()
        assert outputs() == stopped_at

        page.click("#pause-toggle")  # resume (no confirmation)
        page.wait_for_function("document.querySelector('#engine-status').textContent === 'ready'")
        page.wait_for_function(f"""() => [...kvops.state().requests.values()].find(
            r => r.job_id === "{job}").num_output_tokens > {stopped_at + 5}""")
        page.goto(f"{stack.url}/actions/")
        log = page.inner_text("#actions-log")
        assert "pause" in log and "resume" in log
        assert api["engine"]["name"] == "sim"
        page.evaluate(f"""async () => {{ const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
            await fetch("/api/jobs/{job}/cancel/", {{method: "POST", headers: {{"X-CSRFToken": token}}}}); }}""")
        assert not errors, errors
    finally:  # whatever happens, the job ends and the engine runs (the next tests need it)
        stack.api("POST", f"/api/jobs/{job}/cancel/")  # 409 once it has ended: fine
        assert stack.api("POST", "/api/engines/sim/resume/").status_code == 200


def test_drain_and_undrain_from_the_engine_page(login, stack):
    """An operator drains the engine from its page: the header says draining while a job
    still runs there (its tokens keep coming), drained once it has ended, and the API
    agrees; undrain, and both say ready again. The engine is undrained at the end
    whatever happens."""
    page, errors = login(stack, "admin", "admin-pass-123")
    job = stack.api("POST", "/api/jobs/", json={"prompt": "drain around me " * 8,
                                                 "max_tokens": 4000, "engine": "sim"}).json()["id"]

    def api_state() -> str:
        return stack.api("GET", "/api/engines/sim/").json()["engine"]["state"]

    def outputs() -> int:
        return page.evaluate(f"""() => [...kvops.state().requests.values()].find(
            r => r.job_id === "{job}").num_output_tokens""")

    try:
        page.goto(f"{stack.url}/engines/sim/")
        page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1")
        page.wait_for_function(f"""() => kvops.state() && [...kvops.state().requests.values()].some(
            r => r.job_id === "{job}" && r.status === "running" && r.num_output_tokens > 3)""")
        assert page.inner_text("#engine-status") == "ready" and api_state() == "ready"
        assert page.inner_text("#drain-toggle") == "Drain"
        page.click("#drain-toggle")
        page.click("#confirm-ok")
        page.wait_for_function("document.querySelector('#engine-status').textContent === 'draining'")
        page.wait_for_function("document.querySelector('#answer').textContent.includes('HTTP 200')")
        assert page.inner_text("#drain-toggle") == "Undrain"
        stack.wait(lambda: api_state() == "draining", "the API saying draining", 15)
        running_at = outputs()  # draining routes nothing new here; what runs goes on
        page.wait_for_function(f"""() => [...kvops.state().requests.values()].find(
            r => r.job_id === "{job}").num_output_tokens > {running_at + 5}""")

        assert stack.api("POST", f"/api/jobs/{job}/cancel/").status_code == 200
        page.wait_for_function("kvopsPerf.engineState === 'drained'"
                               " && document.querySelector('#engine-status').textContent === 'drained'")
        stack.wait(lambda: api_state() == "drained", "the API saying drained", 15)
        assert page.inner_text("#drain-toggle") == "Undrain"

        page.click("#drain-toggle")  # undrain (no confirmation)
        page.wait_for_function("document.querySelector('#engine-status').textContent === 'ready'")
        assert page.inner_text("#drain-toggle") == "Drain"
        stack.wait(lambda: api_state() == "ready", "the API saying ready", 15)
        page.wait_for_function("kvopsPerf.engineState === 'ready'")
        page.wait_for_function("""() => { const t = document.querySelector('#actions').textContent;
            return t.includes('undrain') && t.replace(/undrain/g, '').includes('drain'); }""")
        assert not errors, errors
    finally:
        stack.api("POST", f"/api/jobs/{job}/cancel/")  # 409 once it has ended: fine
        assert stack.api("POST", "/api/engines/sim/undrain/").status_code == 200


USED = "(s) => [...s.gpu.state].filter((x) => x === 1).length"  # colors.js STATE.used


def drag_timeline_to(page, when: float) -> None:
    """Drag the timeline's thumb from live to about the position of time `when` (Unix
    seconds) with the mouse, then step it there with the arrow keys (0.1 s a press)."""
    box = page.locator("#timeline-range").bounding_box()
    frac = page.evaluate("""(when) => { const r = document.querySelector("#timeline-range");
        return (when - kvops.timeline.span.newest - r.min) / -r.min; }""", when)
    thumb = 8  # about half of Chromium's range thumb: the track's ends are its centre's
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] - thumb, y)
    page.mouse.down()
    page.mouse.move(box["x"] + thumb + frac * (box["width"] - 2 * thumb), y, steps=12)
    page.mouse.up()
    try:
        page.wait_for_function("kvops.scrubbing() && kvops.timeline.want !== null")
    except Exception:
        raise AssertionError(f"the drag from {box} did not scrub: " + page.evaluate("""() => {
            const r = document.querySelector("#timeline-range"), t = kvops.timeline;
            return JSON.stringify({value: r.value, min: r.min, disabled: r.disabled, span: t.span,
                                   want: t.want, label: t.atLabel.textContent, scrollY: window.scrollY,
                                   box: r.getBoundingClientRect()}); }""")) from None
    off = page.evaluate(f"{when} - kvops.timeline.want")  # the scale is fixed while scrubbing
    page.focus("#timeline-range")
    for _ in range(round(abs(off) / 0.1)):
        page.keyboard.press("ArrowRight" if off > 0 else "ArrowLeft")


def test_the_timeline_shows_an_older_state_and_returns_to_live(login, stack):
    """Drag the engine page's timeline back to a moment before a job took its blocks: the
    map, the table and the header show that moment (no block used) while live updates
    wait; back to live, the job's blocks show again."""
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1")
    page.wait_for_function(f"({USED})(kvops.state()) === 0")  # the other tests' jobs have ended
    idle_from = page.evaluate("kvops.state().ts")
    page.wait_for_function(f"kvops.state().ts > {idle_from + 4}")  # 4 s on the engine's clock
    idle_to = page.evaluate(f"({USED})(kvops.state()) === 0 && kvops.state().ts")
    assert idle_to, "a block was used while the engine should have been idle"
    job = stack.api("POST", "/api/jobs/", json={"prompt": "remember this moment " * 8,
                                                 "max_tokens": 4000, "engine": "sim"}).json()["id"]
    try:
        request_id = stack.wait_running(job)
        page.wait_for_function(f"({USED})(kvops.state()) >= 4")
        page.wait_for_function(f"kvops.timeline.span && kvops.timeline.span.newest > {idle_to + 1}")
        middle = (idle_from + idle_to) / 2
        drag_timeline_to(page, middle)
        # (not loading: the state shown is the one at `want`, not one a fetch still replaces)
        page.wait_for_function(f"() => kvops.state() !== kvops.live() && ({USED})(kvops.state()) === 0"
                               f" && Math.abs(kvops.timeline.want - {middle}) < 0.2"
                               " && !kvops.timeline.loading")
        shown = page.evaluate(f"""() => ({{ts: kvops.state().ts, seq: kvops.state().seq,
            job: kvops.state().requestById("{request_id}"), live: ({USED})(kvops.live()),
            liveSeq: kvops.live().seq}})""")
        assert idle_from <= shown["ts"] <= idle_to and shown["job"] is None, shown
        assert shown["live"] >= 4  # the live state went on meanwhile
        assert page.inner_text("#req-count").startswith("0 shown")
        assert page.inner_text("#timeline-at").count("−") == 1
        assert not page.locator(f'.vrow[data-request="{request_id}"]').count()
        page.wait_for_function(f"kvops.live().seq > {shown['liveSeq'] + 3}")  # held, not shown
        assert page.evaluate("kvops.state().seq") == shown["seq"]
        shot(page, "engine-page-timeline")

        page.click("#timeline-live")
        page.wait_for_function(f"() => !kvops.scrubbing() && kvops.state() === kvops.live()"
                               f" && ({USED})(kvops.state()) >= 4")
        page.wait_for_selector(f'.vrow[data-request="{request_id}"]')
        assert page.inner_text("#timeline-at") == "live"
        assert page.evaluate("document.querySelector('#timeline-range').value") == "0"
        assert page.evaluate("kvopsPerf.fetchMs.length") >= 1
        assert not errors, errors
    finally:
        stack.api("POST", f"/api/jobs/{job}/cancel/")
