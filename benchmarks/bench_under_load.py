"""The dashboard while the service streams: the engine page open in a real browser
(headless Chromium) during N concurrent streamed completions on the paced simulator.

    .venv/bin/python -m benchmarks.bench_under_load [--streams 256] [--step-ms 10]

One stack (uvicorn and one engine worker, as benchmarks.bench_serve starts them), the page of
its engine opened as admin, then the streams from a light SSE client; it prints the
page's figures over the streams' run (apply+paint per delta, frame intervals, websocket
KB/s) and the streams' own (delivered tok/s, lost, hung). Chromium shares the machine's
cores with everything else: the streams' numbers here are not bench_serve's.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
from pathlib import Path

from benchmarks.bench_serve import engine_config, make_workload, run_streams
from tests.support.stack import Stack
from kvops.infra.run import ensure_redis
from tests.dashboard.page_perf import measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="how long the page is measured once the streams start")
    args = parser.parse_args(argv)
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    with tempfile.TemporaryDirectory(prefix="kvops-bench-load-") as tmp:
        redis = ensure_redis(os.environ["REDIS_URL"], Path(tmp))
        stack = Stack(Path(tmp))
        try:
            stack.start_web()
            config = engine_config(argparse.Namespace(step_ms=args.step_ms), args.streams,
                                   real=False)
            stack.start_engine("bench", threads=args.streams + 16, **config)
            model = stack.api("GET", "/v1/models", headers={
                "Authorization": f"Bearer {stack.tokens['admin']}"},
                user=None).json()["data"][0]["id"]
            page: dict = {}
            measuring = threading.Event()
            browser = threading.Thread(target=lambda: page.update(
                measure(stack.url, "bench", args.seconds, None, measuring)))
            browser.start()
            if not measuring.wait(180):
                raise RuntimeError("the engine page did not open")
            work = make_workload(args.streams, 200, 400, seed=args.streams)
            results, elapsed = asyncio.run(run_streams(stack.url, stack.tokens["admin"],
                                                       model, work, 300))
            browser.join(300)
        finally:
            stack.stop()
            if redis is not None:
                redis.terminate()
    ok = [r for r in results if r is not None and r.error is None and r.done]
    delivered = sum(n for r, n in zip(results, work.max_tokens) if r in ok)
    row = {"streams": args.streams, "delivered tok/s": round(delivered / elapsed),
           "lost": sum(r is not None and r not in ok for r in results),
           "hung": sum(r is None for r in results), **page}
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    return 1 if row["lost"] or row["hung"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
