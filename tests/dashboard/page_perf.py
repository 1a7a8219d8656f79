"""The engine page's figures in a real browser (headless Chromium): how long applying
and painting a delta takes, frame intervals, and the websocket's bytes, read from
window.kvopsPerf over a window of time. Used by bench_browser (the page at scale) and
bench_under_load (the page while hundreds of streams run)."""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def signed_in_page(playwright, url: str, width: int):
    """Headless Chromium, signed in as the stack's admin: (browser, page)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
    page = browser.new_page(viewport={"width": width, "height": 1000})
    page.goto(f"{url}/accounts/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", "admin-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/")
    return browser, page


def measure(url: str, name: str, seconds: float, screenshot: Path | None,
            measuring: threading.Event | None = None) -> dict:
    """Open the engine page as admin; after its first snapshot and 3 s to settle, measure
    for `seconds` (`measuring` is set when that window opens)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = signed_in_page(p, url, width=1500)
        opened = time.time()
        page.goto(f"{url}/engines/{name}/")
        page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1", timeout=60000)
        first_paint = time.time() - opened
        page.evaluate("""() => { window.longTasks = []; new PerformanceObserver((l) =>
            l.getEntries().forEach((e) => longTasks.push(e.duration)))
            .observe({entryTypes: ["longtask"]});
            window.frames_ = []; let last = performance.now();
            const tick = (t) => { frames_.push(t - last); last = t; requestAnimationFrame(tick); };
            requestAnimationFrame(tick); }""")
        time.sleep(3)  # settle after the snapshot
        start = json.loads(page.evaluate("JSON.stringify({b: kvopsPerf.bytes(), "
                                         "f: kvopsPerf.frames(), n: kvopsPerf.applyMs.length})"))
        began = time.time()
        if measuring is not None:
            measuring.set()
        time.sleep(seconds)
        end = json.loads(page.evaluate("""JSON.stringify({
            b: kvopsPerf.bytes(), f: kvopsPerf.frames(),
            apply: kvopsPerf.applyMs, decode: kvopsPerf.decodeMs, resyncs: kvopsPerf.resyncs,
            long: window.longTasks, frames: window.frames_, parts: kvopsPerf.parts,
            requests: kvops.state().requests.size,
            blocks: kvops.state().gpu.n})"""))
        elapsed = time.time() - began
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    apply = end["apply"][start["n"]:]
    frames = end["frames"][-int(seconds * 50):]
    decode = end["decode"][start["n"]:]
    return {
        "blocks": end["blocks"], "requests": end["requests"], "seconds": round(elapsed, 1),
        "first snapshot s": round(first_paint, 2),
        "deltas/s": round(len(apply) / elapsed, 2),
        "KB/s": round((end["b"] - start["b"]) / 1024 / elapsed, 1),
        "KB/delta": round((end["b"] - start["b"]) / 1024 / max(1, len(apply)), 2),
        "apply+paint ms p50": round(statistics.median(apply), 2) if apply else None,
        "apply+paint ms p95": round(percentile(apply, 0.95), 2),
        "apply+paint ms max": round(max(apply), 2) if apply else None,
        "inflate+parse ms p50": round(statistics.median(decode), 2) if decode else None,
        "long tasks (>50 ms)": len(end["long"]), "resyncs": end["resyncs"],
        "frame interval ms p50": round(statistics.median(frames), 1) if frames else None,
        "frame interval ms p95": round(percentile(frames, 0.95), 1),
        "frames over 33 ms": sum(1 for f in frames if f > 33.4),
        "ms per delta: state/maps/table/rest": "/".join(
            f"{end['parts'][k] / max(1, len(end['apply'])):.2f}"
            for k in ("state", "maps", "table", "rest")),
    }
