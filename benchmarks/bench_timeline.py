"""Scrubbing the engine page's timeline at scale, measured in a real browser (headless
Chromium).

    .venv/bin/python -m benchmarks.bench_timeline [--blocks 65536] [--requests 1000]
        [--minutes 5] [--deltas-per-s 10] [--steps-per-delta 5] [--positions 600]

First it stores a history as the publisher does (kvops/dashboard/timeline.py, with the settings'
keyframe interval and byte bound): a simulated engine with a steady population of requests
is stepped as fast as it goes, its KV view is taken through the engine's capture API every
`--steps-per-delta` steps, and the deltas are laid out on a clock of `--deltas-per-s` a
second that ends now (20 ms steps and 10 deltas a second make 5 steps a delta): the deltas
and keyframes `--minutes` of a live engine leave, without waiting that long. Then it opens
the engine page (its engine gone, the page shows the last stored snapshot) and moves the
timeline: from live back to the oldest moment, forward again, then to random moments. Per
position it reports the time to rebuild the state and repaint the maps, the table and the
header (window.kvopsPerf.scrubMs: seek + paint + layout), and the time from the input
event to the next frame; per window fetched, the fetch, and the time to add it to the
replay (its keyframe parsed and its checkpoints built).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import tests.session_redis  # noqa: F401  (a private redis-server; sets REDIS_URL first)
from tests.dashboard.page_perf import percentile, signed_in_page
from tests.support.stack import Stack

# Moves the slider to each offset (seconds before the right end) as a drag does, one
# input event per position, and waits for the position to be shown (after the fetch of
# its window, when it needs one) and for the next frame.
DRIVE = """async (offsets) => {
  const range = document.querySelector("#timeline-range"), perf = kvopsPerf, strip = kvops.timeline;
  const out = [];
  for (const offset of offsets) {
    const shows = perf.scrubMs.length, fetches = perf.fetchMs.length, started = performance.now();
    const parts = { ...perf.scrubParts }, whole = perf.scrubWhole;
    range.value = String(offset);
    range.dispatchEvent(new Event("input"));
    while ((strip.loading || perf.scrubMs.length === shows) && performance.now() - started < 30000) {
      await new Promise((resolve) => setTimeout(resolve, 1));
    }
    if (perf.scrubMs.length === shows) throw new Error(`offset ${offset}: ${strip.atLabel.textContent}`);
    await new Promise((resolve) => requestAnimationFrame(resolve));
    out.push({ ms: perf.scrubMs[shows], seek: perf.seekMs[shows], frame: performance.now() - started,
               fetched: perf.fetchMs.length > fetches, whole: perf.scrubWhole > whole,
               parts: ["maps", "table", "rest"].map((k) => perf.scrubParts[k] - parts[k]) });
  }
  return out;
}"""


def build_history(name: str, blocks: int, num_requests: int, minutes: float,
                  deltas_per_s: float, steps_per_delta: int) -> dict:
    """Step a simulated engine and store its deltas and keyframes as the publisher does,
    on a clock ending now; register the engine and store its last snapshot."""
    from django.conf import settings
    from django.utils import timezone

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.observe.feed import encode, select_events
    from engine.observe.view import Capturer, KVMirror, event_record
    from kvops import live
    from kvops.models import Engine
    from kvops.dashboard.timeline import TimelineWriter, limits_from_settings

    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    name=name, num_gpu_blocks=blocks,
                                    num_cpu_blocks=blocks // 4, max_num_seqs=1024,
                                    max_num_batched_tokens=8192, preemption_mode="swap"),
                       detokenize=False)
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(256)]
    added = 0

    def top_up() -> None:  # keep num_requests live requests, as bench_browser does
        nonlocal added
        for _ in range(num_requests - len(engine.scheduler.requests)):
            prompt = (shared if added % 3 == 0 else []) + [rng.randrange(32000) for _ in
                                                           range(rng.randrange(200, 900))]
            engine.add_request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randrange(500, 3000)),
                               job_id=str(100000 + added))
            added += 1

    capturer, mirror = Capturer(), KVMirror(name, "bench", engine.describe_config())
    # Laying the history out takes longer than the minutes it stands for: its keys must
    # not expire, by the wall clock, before it has been measured.
    writer = TimelineWriter(name, dataclasses.replace(limits_from_settings(), expire_margin_s=7200))
    count = int(minutes * 60 * deltas_per_s)
    per_keyframe = max(1, round(settings.KVOPS_TIMELINE_KEYFRAME_S * deltas_per_s))
    start = time.time() - count / deltas_per_s
    started, stored = time.perf_counter(), 0
    for i in range(count):
        top_up()
        for _ in range(steps_per_delta):
            engine.step_core()  # as the engine core process steps: token ids, no text
        capture = capturer.capture(engine)
        capture.ts = start + i / deltas_per_s  # the clock the history is laid out on
        delta = mirror.apply(capture)
        kept, counts = select_events(capture.events)
        delta["events"], delta["event_counts"] = [event_record(e) for e in kept], counts
        blob = encode(delta)
        stored += len(blob)
        writer.add_delta(mirror.epoch, delta["seq"], capture.ts, blob)
        if i % per_keyframe == 0:
            writer.add_keyframe(mirror.snapshot())
        if i % 300 == 0:
            print(f"  history: {i}/{count} deltas, {time.perf_counter() - started:.0f} s", flush=True)
    snapshot = mirror.snapshot()
    live.store_snapshot(name, snapshot)
    Engine.objects.update_or_create(name=name, defaults={
        "worker": f"engine-{name}@bench", "status": "ready", "config": engine.describe_config(),
        "started_at": timezone.now()})
    return {"deltas": count, "delta KB (zlib) avg": round(stored / count / 1024, 1),
            "built in s": round(time.perf_counter() - started)}


def slowest(rows: list[dict], count: int = 3) -> str:
    """The slowest positions: each one's time and its parts, rebuild/maps/table/rest
    (rest: the header and the layout), and whether it was painted whole or came after a
    fetch."""
    worst = sorted(rows, key=lambda r: -r["ms"])[:count]
    return "; ".join(f"{r['ms']:.0f} ({r['seek']:.0f}/" + "/".join(f"{p:.0f}" for p in r["parts"]) + ")"
                     + (" whole" if r["whole"] else "") + (" fetched" if r["fetched"] else "")
                     for r in worst)


def summary(rows: list[dict]) -> dict:
    shown = [r["ms"] for r in rows]
    local = [r for r in rows if not r["fetched"]]
    return {
        "positions": len(rows), "windows fetched": sum(r["fetched"] for r in rows),
        "rebuild+repaint ms p50": round(statistics.median(shown), 1),
        "rebuild+repaint ms p95": round(percentile(shown, 0.95), 1),
        "rebuild+repaint ms max": round(max(shown), 1),
        "of which rebuild ms p50": round(statistics.median(r["seek"] for r in rows), 1),
        "input to next frame ms p50 (no fetch)": round(statistics.median(r["frame"] for r in local), 1)
        if local else None,
        "input to next frame ms p95 (no fetch)": round(percentile([r["frame"] for r in local], 0.95), 1)
        if local else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--deltas-per-s", type=float, default=10.0)
    parser.add_argument("--steps-per-delta", type=int, default=5)
    parser.add_argument("--positions", type=int, default=600, help="per pass over the history")
    parser.add_argument("--screenshot", type=Path, default=None)
    args = parser.parse_args(argv)
    stack = Stack(Path(tempfile.mkdtemp(prefix="kvops-bench-")))
    # The history written here must land in the stack's database and Redis database.
    os.environ.update({k: stack.env[k] for k in ("DATABASE_URL", "KVOPS_DATA_DIR", "REDIS_URL")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")
    import django
    django.setup()
    from playwright.sync_api import sync_playwright

    from kvops.dashboard import timeline

    try:
        stack.start_web()
        built = build_history("big", args.blocks, args.requests, args.minutes, args.deltas_per_s,
                              args.steps_per_delta)
        windows, newest = timeline.windows("big")
        built["history kept s"] = round(newest - windows[0]["start"], 1)
        built["windows"] = len(windows)
        built["stored MB"] = round(sum(w["bytes"] for w in windows) / 2**20, 1)
        with sync_playwright() as p:
            browser, page = signed_in_page(p, stack.url, width=1500)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{stack.url}/engines/big/")
            try:
                page.wait_for_function("window.kvopsPerf && kvopsPerf.snapshots >= 1", timeout=60000)
            except Exception:
                print("the page got no snapshot:", errors,
                      page.evaluate("window.kvopsPerf ? kvopsPerf.log : 'its script did not run'"))
                raise
            page.wait_for_function("kvops.timeline.span !== null", timeout=30000)
            span = page.evaluate("-Number(document.querySelector('#timeline-range').min)")
            step = span / args.positions
            back = [-(k + 1) * step for k in range(args.positions)]
            rng = random.Random(1)
            passes = {"live -> oldest": back, "oldest -> live": back[::-1],
                      "random jumps": [-rng.uniform(0.1, span) for _ in range(args.positions // 3)]}
            results = {}
            worst = {}
            for label, offsets in passes.items():
                rows = page.evaluate(DRIVE, offsets)
                results[label] = summary(rows)
                results[label]["ms a position: maps/table/rest"] = "/".join(
                    f"{statistics.fmean(r['parts'][k] for r in rows):.1f}" for k in range(3))
                worst[label] = slowest(rows)
            fetch = page.evaluate("kvopsPerf.fetchMs")
            added = page.evaluate("kvopsPerf.addMs")
            blocks = page.evaluate("kvops.state().gpu.n")
            if args.screenshot is not None:
                args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.screenshot), full_page=True)
            browser.close()
    finally:
        stack.stop()
    print(f"history: {blocks} GPU blocks, {args.requests} requests, {args.steps_per_delta} steps a "
          f"delta, {args.deltas_per_s:g} deltas/s")
    for key, value in built.items():
        print(f"  {key:<40} {value}")
    print(f"window fetches: {len(fetch)}, ms p50 {statistics.median(fetch):.0f}, "
          f"max {max(fetch):.0f}; then added (parsed, checkpoints built), ms p50 "
          f"{statistics.median(added):.0f}, max {max(added):.0f}")
    labels = list(results)
    keys = list(results[labels[0]])
    width = max(len(k) for k in keys)
    print(f"{'':<{width}}  " + "  ".join(f"{label:>15}" for label in labels))
    for key in keys:
        print(f"{key:<{width}}  " + "  ".join(f"{str(results[label][key]):>15}" for label in labels))
    print("slowest positions, ms (rebuild/maps/table/rest):")
    for label in labels:
        print(f"  {label}: {worst[label]}")


if __name__ == "__main__":
    main()
