"""The docs' screenshots of the pages: `python -m tests.dashboard.screenshot [--out
docs/engine-page.png]` (the README's, with a shared block's tooltip open) and beside it
overview.png, jobs-page.png, job-page.png and actions-page.png.

A real stack (uvicorn, one simulated engine worker) is driven through the REST API into a
state that shows every colour: finished jobs leave cached blocks, a pinned system prompt,
running jobs sharing a prefix, a full pool (so the next evictions are marked), one job
swapped out by an operator and one preempted.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import tests.session_redis  # noqa: F401  (a private redis-server; sets REDIS_URL first)
from tests.dashboard.page_perf import signed_in_page
from tests.support.stack import Stack
SYSTEM = "You are kvops, a careful assistant. Answer briefly and cite the block tables. " * 3


def job(stack: Stack, prompt: str, max_tokens: int) -> dict:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()


def drive(stack: Stack) -> int:
    """Put the engine in a state that shows every colour; a finished job that hit the
    pinned prefix (for the job page)."""
    short = [job(stack, f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * 6, 12)
             for i in range(36)]
    first = job(stack, SYSTEM + "Say hello.", 4)
    for j in short + [first]:
        stack.wait_job(j["id"], timeout_s=120)
    r = stack.api("POST", "/api/engines/gpu0/prefix-cache/pin/", json={"prompt": SYSTEM})
    r.raise_for_status()
    long = [job(stack, (SYSTEM if i % 3 else "") + f"Question {i}: explain paged attention. "
                * (1 + i % 3), 3000) for i in range(18)]
    time.sleep(14)
    swapped = stack.wait_running(long[4]["id"], 60)
    stack.api("POST", f"/api/engines/gpu0/requests/{swapped}/swap-out/").raise_for_status()
    preempted = stack.wait_running(long[7]["id"], 60)
    stack.api("POST", f"/api/engines/gpu0/requests/{preempted}/preempt/").raise_for_status()
    hit = job(stack, SYSTEM + "Which blocks did you share?", 24)
    stack.wait_job(hit["id"], timeout_s=120)
    return hit["id"]


def capture(stack: Stack, out: Path, job_id: int) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = signed_in_page(p, stack.url, width=1440)
        page.goto(f"{stack.url}/engines/gpu0/")
        page.wait_for_function("window.kvopsPerf && kvopsPerf.deltas >= 10")
        time.sleep(6)  # charts gather a few points
        x, y = page.evaluate("""() => {  // a shared block in a running request
            const s = kvops.state(), m = kvops.gpuMap, box = m.canvas.getBoundingClientRect();
            let id = s.gpu.ref_cnt.findIndex((r, i) => r > 1 && s.gpu.state[i] === 1);
            if (id < 0) id = 0;
            const [cx, cy] = m.center(id);
            return [box.left + cx, box.top + cy]; }""")
        page.mouse.move(x, y)
        time.sleep(1.0)  # the block's answer (its text, last use, eviction place)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        for path, name in (("/", "overview"), ("/jobs/", "jobs-page"),
                           (f"/jobs/{job_id}/", "job-page"), ("/actions/", "actions-page")):
            page.goto(f"{stack.url}{path}")
            page.wait_for_load_state("load")
            time.sleep(3)  # live data and charts arrive
            page.screenshot(path=str(out.parent / f"{name}.png"), full_page=True)
        browser.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/engine-page.png"))
    args = parser.parse_args(argv)
    stack = Stack(Path(tempfile.mkdtemp(prefix="kvops-shot-")))
    try:
        stack.start_web()
        stack.start_engine("gpu0", simulate=1, vocab_size=32000, num_gpu_blocks=1536,
                           num_cpu_blocks=384, block_size=16, max_num_seqs=32,
                           simulate_step_ms=30)
        capture(stack, args.out, drive(stack))
    finally:
        stack.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
