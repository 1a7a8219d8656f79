"""Moving requests between engines from the dashboard, in headless Chromium against the
real stack (uvicorn, two simulated engine workers of the same model, Redis, SQLite): an
operator moves a running request with its row's Migrate control and the page says how
the move went, the job's page (open meanwhile) says where the job ran, and the API agrees;
a drain with the mode "migrate" moves a running job off the engine. A plain user gets
neither control. tests/service/test_migration.py tests the same moves through the API."""
import re
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
SIM = dict(simulate=1, block_size=16, num_gpu_blocks=512, num_cpu_blocks=0, max_num_seqs=8,
           simulate_step_ms=20)
MOVED = re.compile(r"moved to b in [\d,]+ ms \(pause [\d.,]+ ms, [\d,]+ blocks? sent, [\d,]+ cached\)")
# the engine page's answer panel once its text says `what` (a string argument)
ANSWER_SAYS = "(what) => document.querySelector('#answer').textContent.includes(what)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("migration-browser")))
    try:
        s.start_web()
        for name in ("a", "b"):
            s.start_engine(name, **SIM)
        yield s
    finally:
        s.stop()


def start_long_job(stack, prompt: str, max_tokens: int) -> tuple[int, str]:
    """A job on engine a that runs for a while; (its id, its request id there)."""
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": max_tokens,
                                              "engine": "a", "ignore_eos": True})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    return job_id, stack.wait_running(job_id)


def job(stack, job_id: int) -> dict:
    return stack.api("GET", f"/api/jobs/{job_id}/").json()


def engine_state(stack, name: str) -> str:
    return stack.api("GET", f"/api/engines/{name}/").json()["engine"]["state"]


def test_an_operator_moves_a_running_request_from_its_row(login, stack):
    # long enough to still run after the pages load (cancelled at the end)
    job_id, rid = start_long_job(stack, "a request moved from the engine page " * 3, 2000)
    row = f'.vrow[data-request="{rid}"]'
    try:
        plain, plain_errors = login(stack, "alice", "alice-pass-123")
        plain.goto(f"{stack.url}/engines/a/")
        plain.wait_for_selector(row)  # (another user's request, shown as such)
        assert plain.locator("select[data-to], button[data-action=migrate], #selected-move, "
                             "#drain-mode").count() == 0
        assert not plain_errors, plain_errors

        page, errors = login(stack, "admin", "admin-pass-123")
        job_page = page.context.new_page()  # open before the move: it follows it live
        job_page.goto(f"{stack.url}/jobs/{job_id}/")
        job_page.wait_for_function("document.querySelector('#status').textContent === 'running'")
        assert job_page.locator("#ran-on").count() == 0  # one engine so far

        page.goto(f"{stack.url}/engines/a/")
        chooser = page.locator(f"{row} select[data-to]")
        chooser.wait_for()  # the engine list read: b may take it
        assert chooser.locator("option").all_inner_texts() == ["b"]
        chooser.select_option("b")
        page.click(f"{row} button[data-action=migrate]")
        assert "to b" in page.inner_text("#confirm-text")
        page.click("#confirm-ok")
        page.wait_for_function(ANSWER_SAYS, arg="HTTP 200")
        answer = page.inner_text("#answer")
        assert MOVED.search(answer), answer
        assert f"Migrate {rid}: moved to b" in answer

        moved = job(stack, job_id)
        assert moved["engine"] == "b" and moved["status"] == "running", moved
        assert [(e["engine"], e["reason"]) for e in moved["engines"]] == \
            [("a", "start"), ("b", "migration")]
        job_page.wait_for_function(
            "document.querySelector('#ran-on')?.textContent.startsWith('ran on a, then b (moved at ')")
        assert not errors, errors
    finally:
        stack.api("POST", f"/api/jobs/{job_id}/cancel/")  # 409 once it has ended: fine


def test_a_drain_in_mode_migrate_moves_the_running_job_off(login, stack):
    job_id, rid = start_long_job(stack, "a request the drain moves " * 3, 300)
    page, errors = login(stack, "admin", "admin-pass-123")
    try:
        page.goto(f"{stack.url}/engines/a/")
        page.wait_for_selector(f'.vrow[data-request="{rid}"]')
        assert page.inner_text("#drain-toggle") == "Drain"
        page.select_option("#drain-mode", "migrate")
        page.click("#drain-toggle")
        assert "move" in page.inner_text("#confirm-text")
        page.click("#confirm-ok")
        page.wait_for_function(ANSWER_SAYS, arg="its requests move to b")
        assert '"mode": "migrate"' in page.inner_text("#answer")
        assert page.inner_text("#drain-toggle") == "Undrain"
        assert page.locator("#drain-mode").is_hidden()

        final = stack.wait_job(job_id)
        assert final["status"] == "finished" and final["engine"] == "b", final
        assert [e["engine"] for e in final["engines"]] == ["a", "b"]
        stack.wait(lambda: engine_state(stack, "a") == "drained", "a drained", 30)

        page.click("#drain-toggle")  # undrain (no confirmation)
        page.wait_for_function("document.querySelector('#engine-status').textContent === 'ready'")
        assert page.locator("#drain-mode").is_visible()
        stack.wait(lambda: engine_state(stack, "a") == "ready", "a ready", 15)
        assert not errors, errors
    finally:
        stack.api("POST", f"/api/jobs/{job_id}/cancel/")  # 409 once it has ended: fine
        assert stack.api("POST", "/api/engines/a/undrain/").status_code == 200
