"""Prefix-aware routing vs round-robin: `python -m benchmarks.bench_routing`.

Starts a throwaway deployment (web server + two simulated engine workers whose steps
take GPU-like time: a fixed cost plus a cost per computed token) once per policy, sends
the same burst of jobs through the REST API (4 shared system prompts), and prints the
prefix-cache hit rate and throughput of each. Loopback only; bounded in jobs and time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.sim.capacity import format_table
from tests.support.stack import Stack

# Each engine can hold two of the four system prompts with room to run, not all four.
ENGINE = dict(simulate=1, num_gpu_blocks=112, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=512, simulate_step_ms=5, simulate_token_us=100)


def workload(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    systems = [f"[system {i}] " + "".join(rng.choice("abcdefghij ") for _ in range(500))
               for i in range(4)]
    return [rng.choice(systems) + f" question {j}: " + "x" * rng.randint(5, 60)
            for j in range(n)]


def run_policy(policy: str, prompts: list[str], max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvops-bench-") as tmp:
        stack = Stack(Path(tmp), env={"KVOPS_ROUTING": policy})
        try:
            stack.start_web()
            for name in ("east", "west"):
                stack.start_engine(name, **ENGINE)
            started = time.monotonic()
            with ThreadPoolExecutor(16) as pool:
                ids = list(pool.map(lambda p: stack.api("POST", "/api/jobs/", json={
                    "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}).json()["id"],
                    prompts))
                jobs = list(pool.map(lambda i: stack.wait_job(i, timeout_s=600), ids))
            elapsed = time.monotonic() - started
        finally:
            stack.stop()
    prompt_tokens = sum(j["num_prompt_tokens"] for j in jobs)
    cached = sum(j["num_cached_tokens"] for j in jobs)
    latency = [_seconds(j["finished_at"]) - _seconds(j["queued_at"]) for j in jobs]
    return {"policy": policy, "jobs": len(jobs),
            "finished": sum(j["status"] == "finished" for j in jobs),
            "hit_rate": cached / max(prompt_tokens, 1), "seconds": elapsed,
            "jobs_per_s": len(jobs) / elapsed,
            "tokens_per_s": sum(j["num_output_tokens"] for j in jobs) / elapsed,
            "p50": statistics.median(latency), "split": _split(jobs)}


def _seconds(iso: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _split(jobs: list[dict]) -> str:
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j["engine"]] = counts.get(j["engine"], 0) + 1
    return "/".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_routing", description=__doc__)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    prompts = workload(args.jobs)
    rows = []
    for policy in ("prefix", "round-robin"):
        r = run_policy(policy, prompts, args.max_tokens)
        rows.append([r["policy"], f"{r['finished']}/{r['jobs']}", f"{100 * r['hit_rate']:.1f}%",
                     f"{r['seconds']:.1f}", f"{r['jobs_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['p50']:.2f}", r["split"]])
    print(f"{args.jobs} jobs, 4 shared ~500-token system prompts, 2 simulated engines "
          f"({ENGINE['num_gpu_blocks']} blocks x {ENGINE['block_size']} each, "
          f"{ENGINE['simulate_step_ms']} ms/step + {ENGINE['simulate_token_us']} us/token)")
    print(format_table(["routing", "finished", "prefix hit", "seconds", "jobs/s",
                        "out tok/s", "p50 latency s", "jobs per engine"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
