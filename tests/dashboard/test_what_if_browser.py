"""The engine page's "What if" panel in headless Chromium against a real stack (uvicorn,
a simulated engine worker, the ops worker, Redis, SQLite): an operator fills the form,
runs it, and sees both replays side by side; someone who is not an operator has no
panel. A screenshot goes to artifacts/dashboard/what-if.png (looked at, not compared)."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("what-if-browser")))
    try:
        s.start_web()
        s.start_engine("sim", simulate=1, vocab_size=32000, num_gpu_blocks=64,
                       num_cpu_blocks=32, block_size=16, max_num_seqs=8, simulate_step_ms=2)
        s.start_ops_worker()
        ids = []
        for i in range(8):
            r = s.api("POST", "/api/jobs/", json={
                "prompt": "A shared system prompt about paged KV caches. " + f"Question {i}?",
                "max_tokens": 30 + 5 * i, "engine": "sim"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        for job_id in ids:
            assert s.wait_job(job_id, timeout_s=120)["status"] == "finished"
        yield s
    finally:
        s.stop()


def cells(page, run: str) -> dict[str, str]:
    return page.evaluate("""(run) => Object.fromEntries([...document.querySelectorAll(
        "#wi-table tr[data-row]")].map((tr) => [tr.dataset.row,
        tr.querySelector(`td[data-run="${run}"]`).textContent]))""", run)


def test_an_operator_runs_a_what_if_and_sees_both_runs(login, stack):
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_selector("#what-if")
    page.fill("#wi-minutes", "10")
    page.fill("#wi-num-gpu-blocks", "16")
    page.select_option("#wi-preemption-mode", "swap")
    page.fill("#wi-max-num-seqs", "4")
    page.select_option("#wi-cpu-prefix-cache", "true")
    page.click("#wi-run")
    page.wait_for_selector("#what-if[data-status=finished]", timeout=120_000)

    head = page.inner_text("#wi-table thead")
    assert "engine's configuration" in head and "alternative" in head
    base, alt = cells(page, "baseline"), cells(page, "alternative")
    assert base["GPU pool"] == "64 × 16 = 1024 tokens"
    assert alt["GPU pool"] == "16 × 16 = 256 tokens"
    assert (base["preemption"], alt["preemption"]) == ("recompute", "swap")
    assert (base["max_num_seqs"], alt["max_num_seqs"]) == ("8", "4")
    assert (base["CPU prefix tier"], alt["CPU prefix tier"]) == ("off", "on")
    for row in ("KV usage, peak", "preemptions (recompute)", "prefix hit rate",
                "queue wait p50", "queue wait p99"):
        assert base[row] not in ("", "–") and alt[row] not in ("", "–"), row
    assert "Replayed 8 jobs" in page.inner_text("#wi-trace")
    # Both charts have something drawn on them.
    for canvas in ("#wi-chart-kv", "#wi-chart-waiting"):
        assert inked(page, canvas) > 100, canvas
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#what-if").screenshot(path=str(ARTIFACTS / "what-if.png"))

    # A refusal says why, in the panel.
    page.fill("#wi-num-gpu-blocks", "1")
    page.click("#wi-run")
    page.wait_for_function("document.querySelector('#wi-status').textContent.includes("
                           "'cannot hold the longest job')")
    # The page opened again shows the latest run.
    page.reload()
    page.wait_for_selector("#what-if[data-status=finished]")
    assert cells(page, "alternative")["GPU pool"] == "16 × 16 = 256 tokens"
    assert not errors, errors


def test_the_tier_and_policy_levers_and_ttft(login, stack):
    """A disk tier straight below the GPU, another eviction policy and pin budget, from
    the form; the rows show them and the replays' TTFT. A simulated engine has no K/V dtype to
    change: no such field."""
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_selector("#what-if")
    assert page.locator("#wi-kv-cache-dtype").count() == 0
    page.fill("#wi-minutes", "10")
    page.fill("#wi-num-gpu-blocks", "16")
    page.fill("#wi-disk-cache-gib", "0.5")
    page.select_option("#wi-eviction-policy", "slru")
    assert page.get_attribute("#wi-pin-budget", "placeholder") == "50"
    page.fill("#wi-pin-budget", "10")
    page.click("#wi-run")
    page.wait_for_function("document.querySelector('#what-if').dataset.status === 'finished' && "
                           "document.querySelector('#wi-table').textContent.includes('slru')",
                           timeout=120_000)
    base, alt = cells(page, "baseline"), cells(page, "alternative")
    assert (base["disk tier"], alt["disk tier"]) == ("off", "512 MiB")
    assert (base["eviction policy"], alt["eviction policy"]) == ("lru", "slru")
    assert (base["pin budget"], alt["pin budget"]) == ("50.0%", "10.0%")
    for row in ("TTFT p50", "TTFT p99", "prompt tokens computed", "  of which from disk"):
        assert base[row] not in ("", "–") and alt[row] not in ("", "–"), row
    assert not errors, errors


def inked(page, selector: str) -> int:
    """Pixels drawn on a canvas."""
    return page.evaluate("""(sel) => { const c = document.querySelector(sel);
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""", selector)


def test_a_sweep_of_the_gpu_pool_draws_hit_rate_and_ttft_against_it(login, stack):
    """The lever chosen, its values suggested from the engine's (64 blocks: halved to
    quadrupled); the run's table has a column a value and both charts are drawn."""
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_selector("#what-if")
    page.fill("#wi-minutes", "10")
    page.select_option("#wi-sweep-lever", "num_gpu_blocks")
    assert page.input_value("#wi-sweep-values") == "32, 64, 128, 256"
    page.fill("#wi-sweep-values", "16, 32, 64, 128")
    page.click("#wi-run")
    page.wait_for_function("document.querySelector('#what-if').dataset.status === 'finished' && "
                           "!document.querySelector('#wi-sweep').hidden", timeout=120_000)
    assert page.locator("#wi-results").is_hidden()
    head = page.inner_text("#wi-sweep-table thead")
    for column in ("engine's configuration", "GPU blocks 16", "GPU blocks 128"):
        assert column in head, head
    hit_row = page.locator("#wi-sweep-table tr[data-row='prefix hit rate'] td").all_inner_texts()
    assert len(hit_row) == 6 and all(c.endswith("%") for c in hit_row[1:]), hit_row
    assert page.locator("#wi-sweep .wi-lever").first.text_content() == "GPU blocks"
    for canvas in ("#wi-chart-sweep-hit", "#wi-chart-sweep-ttft"):
        assert inked(page, canvas) > 100, canvas
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#what-if").screenshot(path=str(ARTIFACTS / "what-if-sweep.png"))
    assert not errors, errors


def test_no_panel_for_someone_who_is_not_an_operator(login, stack):
    page, errors = login(stack, "alice", "alice-pass-123")
    page.goto(f"{stack.url}/engines/sim/")
    page.wait_for_selector("#requests")
    assert page.locator("#what-if").count() == 0
    assert not errors, errors
