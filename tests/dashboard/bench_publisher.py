"""What live publishing costs the engine's step loop, at dashboard scale.

    .venv/bin/python -m tests.dashboard.bench_publisher [--blocks 65536] [--requests 1000]
        [--seconds 20] [--step-ms 20 0]

Runs the simulated engine in an EngineService (the worker's loop thread) with a fixed
population of requests, once without the publisher and once with it (sending to a
private Redis through the real channel layer), and prints steps/s, generated tokens/s,
the loop-thread time of the hook and the publisher thread's time per delta.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import tests.session_redis  # noqa: F401  (a private redis-server; sets REDIS_URL first)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")


def population(num_requests: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 100-600 tokens; every third one starts with the same 256-token prefix.
    (Short enough that 1,000 of them growing for a row's time fit in 65,536 blocks: both
    rows of a pair then go through the same states, without preemption.)"""
    rng = random.Random(seed)
    shared = [rng.randrange(32000) for _ in range(256)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(32000) for _ in
                                              range(rng.randrange(100, 600))]
            for i in range(num_requests)]


def run(blocks: int, num_requests: int, seconds: float, step_ms: float,
        publish: bool) -> dict:
    from engine import EngineConfig
    from kvops.engine_service import EngineService
    from kvops.publisher import EnginePublisher

    name = f"bench{int(time.time() * 1000) % 100000}"
    config = EngineConfig(simulate=True, num_gpu_blocks=blocks, num_cpu_blocks=blocks // 4,
                          max_num_seqs=1024, max_num_batched_tokens=8192,
                          simulate_step_ms=step_ms, name=name, preemption_mode="swap")
    service = EngineService(config)
    publisher = EnginePublisher(name) if publish else None
    if publisher is not None:
        service.add_hook(publisher)
    service.start()
    prompts = population(num_requests)

    def add_all(engine) -> None:
        from engine import SamplingParams
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3000))

    service.call(add_all)
    time.sleep(3.0)  # past the prefill burst
    start = service.call(lambda e: (time.perf_counter(), e.step_count,
                                    e.scheduler.counters.num_generation_tokens))
    if publisher is not None:
        before = (publisher.stats.captures, publisher.stats.capture_s, publisher.stats.deltas,
                  publisher.stats.publish_s, publisher.stats.delta_bytes,
                  publisher.stats.publish_cpu_s)
    time.sleep(seconds)
    end = service.call(lambda e: (time.perf_counter(), e.step_count,
                                  e.scheduler.counters.num_generation_tokens,
                                  e.metrics()["running"], e.kv.gpu.usage))
    service.stop()
    elapsed = end[0] - start[0]
    row = {"publisher": "on" if publish else "off", "step_ms": step_ms,
           "steps/s": (end[1] - start[1]) / elapsed,
           "tokens/s": (end[2] - start[2]) / elapsed, "running": end[3],
           "kv_usage": end[4]}
    if publisher is not None:
        s = publisher.stats
        captures, deltas = s.captures - before[0], max(1, s.deltas - before[2])
        row.update({
            "deltas/s": deltas / elapsed,
            "hook ms/capture": 1000 * (s.capture_s - before[1]) / max(1, captures),
            "loop share %": 100 * (s.capture_s - before[1]) / elapsed,
            "thread ms/delta": 1000 * (s.publish_s - before[3]) / deltas,
            "thread CPU ms/delta": 1000 * (s.publish_cpu_s - before[5]) / deltas,
            "KB/s": (s.delta_bytes - before[4]) / 1024 / elapsed,
        })
        publisher.close()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[20.0, 0.0])
    parser.add_argument("--repeat", type=int, default=2, help="off/on pairs per step_ms")
    args = parser.parse_args(argv)
    import django
    django.setup()
    rows = []
    for step_ms in args.step_ms:
        for _ in range(args.repeat):  # alternate, so a change in machine load hits both
            for publish in (False, True):
                rows.append(run(args.blocks, args.requests, args.seconds, step_ms, publish))
                print(rows[-1], file=sys.stderr, flush=True)
    columns = ["publisher", "step_ms", "steps/s", "tokens/s", "running", "kv_usage",
               "deltas/s", "hook ms/capture", "loop share %", "thread ms/delta",
               "thread CPU ms/delta", "KB/s"]
    print(f"{args.blocks} GPU blocks, {args.requests} requests, {args.seconds:g} s per row")
    print(" | ".join(f"{c:>12}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row.get(c, ''):>12.2f}" if isinstance(row.get(c), float)
                         else f"{row.get(c, ''):>12}" for c in columns))


if __name__ == "__main__":
    main()
