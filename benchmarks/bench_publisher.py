"""What live publishing costs the engine's step loop, at dashboard scale.

    .venv/bin/python -m benchmarks.bench_publisher [--blocks 65536] [--requests 1000]
        [--seconds 20] [--step-ms 20 0]

Runs the simulated engine's core on a thread of this process (engine/serve/client.py's
InprocClient, as a worker with KVOPS_ENGINE_CORE=thread runs it) with a fixed population
of requests, once without the live view and once with it and its publisher (sending to a
private Redis through the real channel layer), and prints steps/s, generated tokens/s,
the loop-thread time of the view's captures and its thread's time per delta (the core's
`kv_view` metrics).
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


class _Outputs:
    """The output processor's place: the outputs are dropped (the bench counts steps)."""

    def push(self, outputs) -> None:
        pass

    def fail(self, request_ids, message) -> None:
        pass


def run(blocks: int, num_requests: int, seconds: float, step_ms: float,
        publish: bool) -> dict:
    from engine import EngineConfig, wire
    from engine.serve.client import InprocClient
    from kvops.routing.prefix_index import PrefixIndex
    from kvops.worker.publisher import EnginePublisher

    name = f"bench{int(time.time() * 1000) % 100000}"
    config = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                          num_gpu_blocks=blocks, num_cpu_blocks=blocks // 4,
                          max_num_seqs=1024, max_num_batched_tokens=8192,
                          simulate_step_ms=step_ms, name=name, preemption_mode="swap")
    # The core's loop on a thread of this process, with the live view and its publisher
    # as a worker wires them, or with no view at all
    client = InprocClient(config, _Outputs(),
                          on_kv_item=(lambda item: publisher.on_item(item)) if publish else None)
    publisher = EnginePublisher(name, source=client, prefix_index=PrefixIndex(name, client)) \
        if publish else None
    client.start()
    client.submit_many([wire.add_request(f"r{i}", prompt, {"max_tokens": 3000})
                        for i, prompt in enumerate(population(num_requests))])
    time.sleep(3.0)  # past the prefill burst

    def counters() -> tuple:
        m = client.command("metrics", {})
        view = client.latest_metrics.get("kv_view") or {}
        return (time.perf_counter(), m["num_steps"], m["num_generation_tokens"], m["running"],
                m["kv_usage"], view.get("captures", 0), view.get("capture_s", 0.0),
                view.get("deltas", 0), view.get("publish_s", 0.0),
                view.get("delta_bytes", 0), view.get("publish_cpu_s", 0.0))

    start = counters()
    time.sleep(seconds)
    end = counters()
    client.stop()
    elapsed = end[0] - start[0]
    row = {"publisher": "on" if publish else "off", "step_ms": step_ms,
           "steps/s": (end[1] - start[1]) / elapsed,
           "tokens/s": (end[2] - start[2]) / elapsed, "running": end[3],
           "kv_usage": end[4]}
    if publisher is not None:
        captures, deltas = end[5] - start[5], max(1, end[7] - start[7])
        row.update({
            "deltas/s": deltas / elapsed,
            "hook ms/capture": 1000 * (end[6] - start[6]) / max(1, captures),
            "loop share %": 100 * (end[6] - start[6]) / elapsed,
            "thread ms/delta": 1000 * (end[8] - start[8]) / deltas,
            "thread CPU ms/delta": 1000 * (end[10] - start[10]) / deltas,
            "KB/s": (end[9] - start[9]) / 1024 / elapsed,
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
