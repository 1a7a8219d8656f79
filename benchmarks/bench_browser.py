"""The engine page at scale, measured in a real browser (headless Chromium).

    .venv/bin/python -m benchmarks.bench_browser [--blocks 65536] [--requests 1000]
        [--seconds 30] [--screenshot artifacts/dashboard/scale.png]

Starts the web server (uvicorn) on a private Redis and SQLite file, and, in this process,
a simulated engine exactly as a worker runs it (its core on a thread + the live publisher) with
a steady population of requests added straight to the engine: a thousand jobs would
need a thousand Celery threads writing to SQLite ten times a second, which is not what
is measured here. Then it opens the engine page and reports, from window.kvopsPerf,
how long applying and painting a delta takes and how many bytes the websocket carries.
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

import tests.session_redis  # noqa: F401  (a private redis-server; sets REDIS_URL first)
from tests.dashboard.page_perf import measure
from tests.support.stack import Stack


class _Outputs:
    """The output processor's place: the outputs are dropped (the page draws blocks)."""

    def push(self, outputs) -> None:
        pass

    def fail(self, request_ids, message) -> None:
        pass


def start_engine(name: str, blocks: int, num_requests: int, step_ms: float):
    """The engine's core on a thread of this process with its live view and publisher,
    as a worker with KVOPS_ENGINE_CORE=thread runs them (engine/serve/client.py's
    InprocClient); registered and beating."""
    from django.utils import timezone

    from engine import EngineConfig, wire
    from engine.serve.client import InprocClient
    from kvops.models import Engine
    from kvops.routing.prefix_index import PrefixIndex
    from kvops.worker.publisher import EnginePublisher

    config = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                          name=name, num_gpu_blocks=blocks,
                          num_cpu_blocks=blocks // 4, max_num_seqs=1024,
                          max_num_batched_tokens=8192, simulate_step_ms=step_ms,
                          preemption_mode="swap")
    client = InprocClient(config, _Outputs(), on_kv_item=lambda item: publisher.on_item(item))
    publisher = EnginePublisher(name, source=client,  # as a worker wires them
                                prefix_index=PrefixIndex(name, client))
    client.start()
    fields = {f.name for f in Engine._meta.fields}
    row = {"worker": f"engine-{name}@{socket.gethostname()}", "host": socket.gethostname(),
           "config": client.describe_config(), "status": "ready",
           "started_at": timezone.now(), "last_heartbeat": timezone.now(), "instance": "bench"}
    Engine.objects.update_or_create(name=name, defaults={k: v for k, v in row.items()
                                                          if k in fields})
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(256)]
    added = [0]

    def top_up() -> None:  # keep num_requests live requests
        m = client.command("metrics", {})
        items = []
        for _ in range(num_requests - (m["running"] + m["waiting"] + m["swapped"])):
            i = added[0]
            added[0] += 1
            prompt = (shared if i % 3 == 0 else []) + [rng.randrange(32000) for _ in
                                                       range(rng.randrange(200, 900))]
            items.append(wire.add_request(f"r{i}", prompt,
                                          {"max_tokens": rng.randrange(500, 3000)},
                                          job_id=str(100000 + i)))
        if items:
            client.submit_many(items)

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            top_up()
            Engine.objects.filter(name=name).update(last_heartbeat=timezone.now(),
                                                    metrics=client.latest_metrics)

    top_up()
    threading.Thread(target=beat, daemon=True).start()
    return client, publisher, stop


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
        client, publisher, stop = start_engine("big", args.blocks, args.requests, args.step_ms)
        time.sleep(5)  # past the first prefill burst
        row = measure(stack.url, "big", args.seconds, args.screenshot)
        s = client.latest_metrics.get("kv_view") or {}
        row["engine deltas"] = s.get("deltas", 0)
        row["hook ms/capture"] = round(1000 * s.get("capture_s", 0) / max(1, s.get("captures", 0)), 2)
        row["publisher ms/delta"] = round(1000 * s.get("publish_s", 0) / max(1, s.get("deltas", 0)), 2)
        stop.set()
        client.stop()
        publisher.close()
    finally:
        stack.stop()
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
