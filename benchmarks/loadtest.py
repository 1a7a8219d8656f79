"""Load test: `python -m benchmarks.loadtest [--jobs 2000]`.

Starts a throwaway deployment (web server + two simulated engines) on loopback, submits
the jobs through the REST API from a bounded pool of client threads, waits for all of
them, and reports accepted jobs per second, queue wait and completion times. Then checks
that every job ended and that every engine's KV pool is back to free or cached blocks.
Bounded in jobs and in time; talks to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from engine.sim.capacity import format_table
from engine.observe.snapshot import decode_array
from tests.support.stack import Stack

ENGINE = dict(simulate=1, num_gpu_blocks=2048, block_size=16, max_num_seqs=64,
              max_num_batched_tokens=2048, simulate_step_ms=2)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _settled(stack: Stack, name: str, snap: dict) -> bool:
    """Whether the engine runs nothing any more; its snapshot into `snap`."""
    snap.update(stack.api("GET", f"/api/engines/{name}/").json()["snapshot"])
    return not [r for r in snap["requests"] if r["status"] in ("waiting", "running", "swapped")]


def run(jobs: int, clients: int, deadline_s: float) -> dict:
    rng = random.Random(0)
    prompts = [f"[group {rng.randrange(8)}] " + "lorem ipsum " * rng.randint(2, 40)
               for _ in range(jobs)]
    with tempfile.TemporaryDirectory(prefix="kvops-load-") as tmp:
        stack = Stack(Path(tmp), env={"KVOPS_ROUTING": "prefix"})
        try:
            stack.start_web()
            for name in ("load-a", "load-b"):
                stack.start_engine(name, **ENGINE)
            t0 = time.monotonic()

            def submit(prompt: str) -> int:
                r = stack.api("POST", "/api/jobs/", json={
                    "prompt": prompt, "max_tokens": rng.randint(4, 32)})
                if r.status_code != 201:
                    raise RuntimeError(f"submit failed: {r.status_code} {r.text[:200]}")
                return r.json()["id"]

            with ThreadPoolExecutor(clients) as pool:
                ids = list(pool.map(submit, prompts))
            accepted_s = time.monotonic() - t0
            ended: dict[int, dict] = {}
            while len(ended) < len(ids) and time.monotonic() - t0 < deadline_s:
                ended = {}
                for status in ("finished", "failed", "cancelled"):
                    offset = 0
                    while True:
                        page = stack.api("GET", f"/api/jobs/?limit=500&offset={offset}"
                                                f"&status={status}").json()
                        for job in page["results"]:
                            ended[job["id"]] = job
                        if not page["next"]:
                            break
                        offset += 500
                if len(ended) < len(ids):
                    time.sleep(1.0)
            total_s = time.monotonic() - t0
            pools = {}
            for name in ("load-a", "load-b"):
                snap = {}
                stack.wait(functools.partial(_settled, stack, name, snap), f"engine {name} idle",
                           30)
                states = decode_array(snap["gpu"]["state"])
                pools[name] = {s: int((states == i).sum()) for i, s in enumerate(snap["block_states"])}
        finally:
            stack.stop()
    done = [ended[i] for i in ids if i in ended]
    waits = [_ts(j["started_at"]) - _ts(j["queued_at"]) for j in done if j["started_at"]]
    e2e = [_ts(j["finished_at"]) - _ts(j["queued_at"]) for j in done if j["finished_at"]]
    return {"jobs": len(ids), "ended": len(done),
            "finished": sum(j["status"] == "finished" for j in done),
            "failed": [(j["id"], j["error"]) for j in done if j["status"] == "failed"],
            "accepted_per_s": len(ids) / accepted_s, "accept_s": accepted_s, "total_s": total_s,
            "wait_p50": statistics.median(waits), "wait_p99": _pct(waits, 0.99),
            "e2e_p50": statistics.median(e2e), "e2e_p99": _pct(e2e, 0.99), "pools": pools,
            "per_engine": {n: sum(j["engine"] == n for j in done) for n in pools}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadtest", description=__doc__)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--deadline", type=float, default=600.0, help="give up after this many s")
    args = p.parse_args(argv)
    r = run(args.jobs, args.clients, args.deadline)
    print(f"{r['jobs']} jobs through POST /api/jobs/ from {args.clients} client threads, "
          "2 simulated engines")
    print(format_table(["jobs", "ended", "finished", "accepted/s", "all ended after s",
                        "queue wait p50/p99 s", "end-to-end p50/p99 s"],
                       [[str(r["jobs"]), str(r["ended"]), str(r["finished"]),
                         f"{r['accepted_per_s']:.0f}", f"{r['total_s']:.1f}",
                         f"{r['wait_p50']:.2f}/{r['wait_p99']:.2f}",
                         f"{r['e2e_p50']:.2f}/{r['e2e_p99']:.2f}"]]))
    for name, pool in r["pools"].items():
        print(f"engine {name}: {r['per_engine'][name]} jobs; blocks afterwards {pool}")
    ok = r["ended"] == r["jobs"] == r["finished"] and all(
        pool.get("used", 0) == 0 for pool in r["pools"].values())
    print("OK: every job finished and every pool is back to free/cached" if ok
          else f"NOT OK: failed={r['failed'][:5]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
