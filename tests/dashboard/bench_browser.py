"""The engine page at scale, measured in a real browser (headless Chromium).

    .venv/bin/python -m tests.dashboard.bench_browser [--blocks 65536] [--requests 1000]
        [--seconds 30] [--screenshot artifacts/dashboard/scale.png]

Starts the web server (daphne) on a private Redis and SQLite file, and, in this process,
a simulated engine exactly as a worker runs it (EngineService + the live publisher) with
a steady population of requests added straight to the engine: a thousand jobs would
need a thousand Celery threads writing to SQLite ten times a second, which is not what
is measured here. Then it opens the engine page and reports, from window.kvopsPerf,
how long applying and painting a delta takes and how many bytes the websocket carries.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import tests.session_redis  # noqa: F401  (a private redis-server; sets REDIS_URL first)
from tests.service.stack import Stack

CHROMIUM = "/usr/bin/chromium"


def start_engine(name: str, blocks: int, num_requests: int, step_ms: float):
    """EngineService (its KV feed attached) + EnginePublisher in this process, as a worker
    with KVOPS_ENGINE_CORE=thread runs them; registered and beating."""
    from django.utils import timezone

    from engine import EngineConfig, SamplingParams
    from kvops.engine_service import EngineService
    from kvops.models import Engine
    from kvops.publisher import EnginePublisher

    config = EngineConfig(simulate=True, name=name, num_gpu_blocks=blocks,
                          num_cpu_blocks=blocks // 4, max_num_seqs=1024,
                          max_num_batched_tokens=8192, simulate_step_ms=step_ms,
                          preemption_mode="swap")
    service = EngineService(config)
    service.start()
    publisher = EnginePublisher(name, source=service)  # as a worker wires them
    service.attach_kv_view(publisher.on_item)
    fields = {f.name for f in Engine._meta.fields}
    row = {"worker": f"engine-{name}@{socket.gethostname()}", "host": socket.gethostname(),
           "config": service.call(lambda e: e.describe_config()), "status": "ready",
           "started_at": timezone.now(), "last_heartbeat": timezone.now(), "instance": "bench"}
    Engine.objects.update_or_create(name=name, defaults={k: v for k, v in row.items()
                                                          if k in fields})
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(256)]
    added = [0]

    def top_up(engine) -> None:  # keep num_requests live requests
        for _ in range(num_requests - len(engine.scheduler.requests)):
            i = added[0]
            added[0] += 1
            prompt = (shared if i % 3 == 0 else []) + [rng.randrange(32000) for _ in
                                                       range(rng.randrange(200, 900))]
            params = SamplingParams(max_tokens=rng.randrange(500, 3000))
            engine.add_request(f"r{i}", prompt, params, job_id=str(100000 + i))

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            service.call(top_up)
            Engine.objects.filter(name=name).update(last_heartbeat=timezone.now(),
                                                    metrics=service.latest_metrics)

    service.call(top_up)
    threading.Thread(target=beat, daemon=True).start()
    return service, publisher, stop


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(url: str, name: str, seconds: float, screenshot: Path | None) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{url}/accounts/login/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", "admin-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--screenshot", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvops-bench-"))
    stack = Stack(workdir)
    # The engine and publisher in this process must use the stack's database and its
    # Redis database (the stack picks its own number), or the page never hears them.
    os.environ.update({k: stack.env[k] for k in ("DATABASE_URL", "KVOPS_DATA_DIR",
                                                  "REDIS_URL")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")
    import django
    django.setup()
    try:
        stack.start_web()
        service, publisher, stop = start_engine("big", args.blocks, args.requests, args.step_ms)
        time.sleep(5)  # past the first prefill burst
        row = measure(stack.url, "big", args.seconds, args.screenshot)
        s = service.feed.stats
        row["engine deltas"] = s.deltas
        row["hook ms/capture"] = round(1000 * s.capture_s / max(1, s.captures), 2)
        row["publisher ms/delta"] = round(1000 * s.publish_s / max(1, s.deltas), 2)
        stop.set()
        service.stop()
        publisher.close()
    finally:
        stack.stop()
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
