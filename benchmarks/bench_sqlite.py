"""Write latency with several writer processes on one SQLite file: Django's backend
(SQLite's busy handler) against this one (writers queue on a flock), same workload, same
run: `python -m benchmarks.bench_sqlite`.

Each writer process stands for one of the service's: every few milliseconds (exponential
gaps) it writes a batch of rows in one transaction (as the web stores a burst's jobs, a
worker claims them, the output processor writes progress), or, one time in four, one
UPDATE outside a transaction (as a job's dispatch mark). A write's latency is from the
moment it wants the database to its commit; a transaction holds the database a few
milliseconds (exponential, --hold-ms) before its writes, as the ORM's Python work does
between BEGIN and COMMIT."""
from __future__ import annotations

import argparse
import multiprocessing
import random
import tempfile
import time
from importlib import import_module
from pathlib import Path

BACKENDS = {"django (busy handler)": "django.db.backends.sqlite3",
            "kvops (writer queue)": "kvops.sqlite"}


def _connect(engine: str, path: str):
    import django
    from django.conf import settings
    if not settings.configured:
        settings.configure(USE_TZ=True)
        django.setup()
    from django.db import connections
    config = connections.configure_settings({"default": {
        "ENGINE": engine, "NAME": path,
        "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE",
                    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}}})
    connections["bench"] = import_module(f"{engine}.base").DatabaseWrapper(
        config["default"], "bench")
    return connections["bench"]


def _writer(engine: str, path: str, seed: int, rows: int, gap_ms: float, hold_ms: float,
            seconds: float, start_at: float, out) -> None:
    from django.db import transaction
    db = _connect(engine, path)
    rng = random.Random(seed)
    latencies = []
    with db.cursor() as cursor:
        cursor.execute("SELECT 1")
    time.sleep(max(0.0, start_at - time.time()))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(rng.expovariate(1000.0 / gap_ms))
        first = rng.randrange(0, 4096 - rows)
        started = time.perf_counter()
        if rng.random() < 0.25:
            with db.cursor() as cursor:
                cursor.execute("UPDATE t SET n = n + 1 WHERE id = %s", [first])
        else:
            with transaction.atomic(using="bench"):
                time.sleep(rng.expovariate(1000.0 / hold_ms))  # the ORM's work meanwhile
                with db.cursor() as cursor:
                    cursor.executemany("UPDATE t SET n = n + 1, body = %s WHERE id = %s",
                                       [("x" * 200, i) for i in range(first, first + rows)])
        latencies.append(time.perf_counter() - started)
    db.close()
    out.put(latencies)


def run(engine: str, writers: int, rows: int, gap_ms: float, hold_ms: float,
        seconds: float) -> list[float]:
    with tempfile.TemporaryDirectory() as workdir:
        path = str(Path(workdir) / "bench.sqlite3")
        db = _connect(engine, path)
        with db.cursor() as cursor:
            cursor.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, body TEXT)")
            cursor.executemany("INSERT INTO t (id, n, body) VALUES (%s, 0, '')",
                               [(i,) for i in range(4096)])
        db.close()
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        start_at = time.time() + 2.0  # every writer connected by then
        procs = [context.Process(target=_writer, args=(engine, path, seed, rows, gap_ms,
                                                       hold_ms, seconds, start_at, out))
                 for seed in range(writers)]
        for p in procs:
            p.start()
        latencies = [x for _ in procs for x in out.get()]
        for p in procs:
            p.join()
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--rows", type=int, default=64, help="rows a transaction writes")
    parser.add_argument("--gap-ms", type=float, default=10.0,
                        help="mean pause between one writer's writes")
    parser.add_argument("--hold-ms", type=float, default=5.0,
                        help="mean time a transaction holds the database before its "
                             "writes (the Python work between BEGIN and COMMIT)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2, help="each backend this often, "
                                                              "alternating")
    args = parser.parse_args()

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    results: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(args.rounds):
        for name, engine in BACKENDS.items():
            results[name] += run(engine, args.writers, args.rows, args.gap_ms, args.hold_ms,
                                 args.seconds)
    print(f"{args.writers} writer processes, {args.rows} rows a transaction (1 in 4 writes "
          f"a single UPDATE), transactions held {args.hold_ms:g} ms, {args.gap_ms:g} ms "
          f"mean gap, {args.rounds} x "
          f"{args.seconds:g} s each")
    print(f"{'backend':<24} {'writes':>7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
          f"{'max ms':>7}")
    for name, latencies in results.items():
        latencies.sort()
        print(f"{name:<24} {len(latencies):>7} {pct(latencies, 0.5):>7.1f} "
              f"{pct(latencies, 0.9):>7.1f} {pct(latencies, 0.99):>7.1f} "
              f"{latencies[-1] * 1e3:>7.1f}")


if __name__ == "__main__":
    main()
