"""Streaming benchmark: `python -m benchmarks.bench_serve`.

The service path measured end to end at an engine's pace: a throwaway stack (uvicorn and
one engine worker, loopback only) with the simulated engine paced like a GPU step
(--step-ms), N concurrent streamed completions through /v1 (ignore_eos, 200-400 tokens
each, or --sim-tokens) from a light SSE client in this process, and, in the same run,
the same engine alone (an LLMEngine in a process started as the worker starts its engine
core, with the core's environment and niceness) on the same prompts. Per concurrency it
prints delivered output tok/s, the engine alone, their ratio, TTFT (and the engine
alone's: the service's start costs the difference) and inter-chunk latency percentiles,
the engine's mean step time alone and in the service (from its
kvops:engine_step_seconds; a slower step there is the engine sharing the CPU, not the
service's latency), lost and hung streams, and CPU seconds per 1,000 streamed tokens
of the web process, the worker and this client. `--real N` adds the default model at N
streams (shorter outputs: the CPU makes it slow). `--repeat K` runs each level K times
(the engine alone, then a fresh stack, each time) and shows the median run with the
range of the ratios: on a small shared machine runs of the same code differ by more
than many changes move them.

Bounded: every stream has a deadline; talks to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sim.capacity import format_table
from engine.serve.core_proc import CORE_NICE, raise_priority
from engine.serve.client import core_environment
from tests.support.stack import Stack
from kvops.infra.run import ensure_redis
from benchmarks.sse_client import StreamResult, stream_completion

SIM_VOCAB = 32000


@dataclass(slots=True)
class Workload:
    prompts: list[str]
    max_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(n: int, lo: int, hi: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [f"request {i}: " + "lorem ipsum dolor " * rng.randint(2, 6) for i in range(n)]
    return Workload(prompts, [rng.randint(lo, hi) for _ in range(n)])


def engine_config(args, streams: int, real: bool) -> dict:
    """The engine's settings, as KVOPS_ENGINE_* values and EngineConfig fields alike."""
    history = {} if args.kv_history_blocks is None else \
        {"kv_history_blocks": args.kv_history_blocks}
    if real:  # the default model, named by its folder (a stack has its own data dir)
        from engine.model.model_runner import resolve_model_path
        return dict(model=str(resolve_model_path(None)), max_num_seqs=max(32, streams),
                    max_num_batched_tokens=2048, device=args.real_device,
                    dtype=args.real_dtype, **history)
    return dict(simulate=True, simulate_tokenizer="bytes",
                vocab_size=SIM_VOCAB, simulate_step_ms=args.step_ms,
                max_num_seqs=max(256, streams), num_gpu_blocks=65536,
                max_num_batched_tokens=8192, **history)


def engine_alone(config: dict, work: Workload, core: str = "process") -> dict:
    """The engine by itself running every prompt, all added at once: `elapsed` seconds,
    its mean `step` and its median time to first token (`ttft`), in seconds. In a
    process of its own, started as a worker starts its
    engine core (the core's environment and niceness; for a `thread` core, as the worker
    itself), so that the engine alone and the engine in the service differ by the
    service alone."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_serve", "--alone", core], capture_output=True,
        text=True, input=json.dumps({"config": config, "prompts": work.prompts,
                                     "max_tokens": work.max_tokens}),
        env=core_environment(os.environ, _core_nice()) if core == "process" else None,
        timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the engine alone failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _core_nice() -> int:
    """The niceness a worker of this environment gives its core (kvops/settings.py)."""
    return int(os.environ.get("KVOPS_ENGINE_CORE_NICE") or CORE_NICE)


def _engine_alone_here(core: str) -> None:
    """The engine-alone process (`--alone`): the job from stdin, the result to stdout."""
    job = json.loads(sys.stdin.read())
    if core == "process":  # before the first parallel region starts torch's threads
        raise_priority(_core_nice())
    work = Workload(job["prompts"], job["max_tokens"])
    engine = LLMEngine(EngineConfig(**job["config"]), detokenize=False)  # as a core runs it
    # One short request first, as the service gets one (bench_once): on a GPU the first
    # steps compile the Triton kernels, which neither side's figures should hold.
    engine.generate([[1, 2, 3, 4]], [SamplingParams(max_tokens=4, ignore_eos=True)])
    steps_before, seconds_before = engine.step_count, engine.step_seconds
    for i, (prompt, n) in enumerate(zip(work.prompts, work.max_tokens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                          temperature=0.0))
    started = time.perf_counter()
    produced = 0
    first: dict[str, float] = {}  # request -> seconds to its first token
    while engine.has_unfinished_requests():
        outputs = engine.step_core()
        now = time.perf_counter() - started
        for o in outputs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now
        produced += sum(len(o.request.output_token_ids) for o in outputs if o.finished)
    elapsed = time.perf_counter() - started
    if produced != work.num_tokens:
        raise RuntimeError(f"the engine alone produced {produced} tokens, "
                           f"not {work.num_tokens}")
    step = (engine.step_seconds - seconds_before) / max(engine.step_count - steps_before, 1)
    print(json.dumps({"elapsed": elapsed, "step": step,
                      "ttft": pct(list(first.values()), 0.5)}))


HEARTBEAT_LAG_S = 0.5  # a worker's heartbeat carries metrics its core sent up to this long ago


def engine_step_totals(stack: Stack, engine: str, since: float) -> tuple[int, float]:
    """The engine's steps and seconds spent in them, from its first heartbeat whose
    metrics are newer than `since` (time.time())."""
    metrics = {}

    def fresh() -> bool:
        doc = next(e for e in stack.api("GET", "/api/engines/").json() if e["name"] == engine)
        beat = doc.get("last_heartbeat")
        if not beat or datetime.fromisoformat(beat).timestamp() <= since + HEARTBEAT_LAG_S:
            return False
        metrics.update(doc["metrics"])
        return True

    stack.wait(fresh, f"a heartbeat of engine {engine}", 30)
    return metrics["num_steps"], metrics["step_seconds"]


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # field 5 of stat, after pid and comm
            total += int(fields[11]) + int(fields[12])
    return total / tick


async def run_streams(url: str, token: str, model: str, work: Workload,
                      deadline_s: float) -> tuple[list[StreamResult | None], float]:
    async def one(i: int) -> StreamResult:
        body = {"model": model, "prompt": work.prompts[i], "max_tokens": work.max_tokens[i],
                "ignore_eos": True, "temperature": 0.0}
        return await stream_completion(url, token, body)

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(len(work.prompts))]
    done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    elapsed = time.perf_counter() - started
    return [t.result() if t in done else None for t in tasks], elapsed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(stack: Stack, model: str, work: Workload, alone: dict,
            deadline_s: float) -> dict:
    alone_s, alone_step_s = alone["elapsed"], alone["step"]
    steps0, step_s0 = engine_step_totals(stack, "bench", time.time())
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    cpu0 = {name: group_cpu_s(pid) for name, pid in pids.items()}
    own0 = time.process_time()
    results, elapsed = asyncio.run(run_streams(stack.url, stack.tokens["admin"], model,
                                               work, deadline_s))
    own = time.process_time() - own0
    cpu = {name: group_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    steps1, step_s1 = engine_step_totals(stack, "bench", time.time())
    hung = sum(r is None for r in results)
    lost = sum(r is not None and (r.error is not None or not r.done) for r in results)
    ok = [r for r in results if r is not None and r.error is None and r.done]
    delivered = sum(n for r, n in zip(results, work.max_tokens) if r in ok)
    per_k = 1000 / max(delivered, 1)
    gaps = [g for r in ok for g in r.gaps]
    errors = sorted({r.error for r in results if r is not None and r.error})[:3]
    web = next(n for n in cpu if n == "web")
    worker = [n for n in cpu if n.startswith("engine-")]
    return {
        "streams": len(work.prompts), "tokens": delivered,
        "tok_s": delivered / elapsed, "alone_tok_s": work.num_tokens / alone_s,
        "ratio": (delivered / elapsed) / (work.num_tokens / alone_s),
        "ttft_p50": pct([r.ttft for r in ok if r.ttft is not None], 0.5),
        "ttft_p99": pct([r.ttft for r in ok if r.ttft is not None], 0.99),
        "ttft_alone": alone["ttft"],  # (the service's start costs the difference)
        "gap_p50": pct(gaps, 0.5), "gap_p99": pct(gaps, 0.99),
        "chunks": sum(len(r.chunk_times) for r in ok),
        # the engine's mean step, alone and in the service: how much of the gap is the
        # engine slowed down (sharing the CPU) rather than the service path's latency
        "step_alone": alone_step_s, "step_service": (step_s1 - step_s0) / max(steps1 - steps0, 1),
        "lost": lost, "hung": hung, "errors": errors,
        "cpu_web": cpu[web] * per_k, "cpu_worker": sum(cpu[n] for n in worker) * per_k,
        "cpu_client": own * per_k, "elapsed": elapsed,
    }


def bench_level(args, streams: int, real: bool, tmp: Path) -> dict:
    """One concurrency level, `--repeat` times (each: the engine alone, then the service
    on a fresh stack); the row of the run with the median ratio, with every run's ratio
    and the lost and hung streams of all runs."""
    runs = [bench_once(args, streams, real, tmp, i) for i in range(args.repeat)]
    row = dict(sorted(runs, key=lambda r: r["ratio"])[(len(runs) - 1) // 2])
    row["ratios"] = [r["ratio"] for r in runs]
    row["lost"], row["hung"] = sum(r["lost"] for r in runs), sum(r["hung"] for r in runs)
    row["errors"] = sorted({e for r in runs for e in r["errors"]})[:3]
    return row


def bench_once(args, streams: int, real: bool, tmp: Path, run: int) -> dict:
    config = engine_config(args, streams, real)
    lo, hi = (args.real_tokens, args.real_tokens) if real else args.sim_range
    work = make_workload(streams, lo, hi, seed=streams)
    alone = engine_alone(config, work, args.core)
    workdir = tmp / f"{'real' if real else 'sim'}-{streams}-{run}"
    workdir.mkdir()
    database = fresh_database(args.database_url, f"kvops_bench_{workdir.name}".replace("-", "_")) \
        if args.database_url else None
    stack = Stack(workdir, env={"DATABASE_URL": database} if database else None)
    try:
        stack.start_web()
        stack.start_engine("bench", threads=streams + 16, core=args.core, **config)
        model = stack.api("GET", "/v1/models", headers={
            "Authorization": f"Bearer {stack.tokens['admin']}"}, user=None).json()["data"][0]["id"]
        # One short stream first: imports and connections warm, as in a running service.
        asyncio.run(run_streams(stack.url, stack.tokens["admin"], model,
                                make_workload(1, 4, 4), 60))
        row = measure(stack, model, work, alone, args.deadline)
        row["engine"] = ("default model" if real else f"simulator, {args.step_ms:g} ms step") \
            + f" ({args.core} core{', PostgreSQL' if database else ''})"
        return row
    finally:
        stack.stop()
        if database:
            drop_database(database)


def _admin_connection(url: str):
    import psycopg
    parsed = urlparse(url)
    return psycopg.connect(urlunparse(parsed._replace(path="/postgres")), autocommit=True)


def fresh_database(url: str, name: str) -> str:
    """A new, empty PostgreSQL database named `name` on url's server; its URL."""
    with _admin_connection(url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def drop_database(url: str) -> None:
    with _admin_connection(url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{urlparse(url).path.lstrip("/")}" WITH (FORCE)')


def ratio_cell(row: dict) -> str:
    """The ratio, and with repeats the lowest and highest of the runs."""
    ratios = row.get("ratios") or [row["ratio"]]
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{row['ratio']:.2f}{spread}"


def print_table(rows: list[dict]) -> None:
    print(format_table(
        ["engine", "streams", "delivered tok/s", "engine alone tok/s", "ratio",
         "TTFT p50/p99 ms (alone p50)", "inter-chunk p50/p99 ms", "step ms: alone / service",
         "lost", "hung",
         "CPU s / 1k tok: web, worker, client"],
        [[r["engine"], str(r["streams"]), f"{r['tok_s']:.0f}", f"{r['alone_tok_s']:.0f}",
          ratio_cell(r), f"{1000 * r['ttft_p50']:.0f} / {1000 * r['ttft_p99']:.0f} "
                         f"({1000 * r['ttft_alone']:.0f})",
          f"{1000 * r['gap_p50']:.0f} / {1000 * r['gap_p99']:.0f}",
          f"{1000 * r['step_alone']:.1f} / {1000 * r['step_service']:.1f}",
          str(r["lost"]), str(r["hung"]),
          f"{r['cpu_web']:.3f}, {r['cpu_worker']:.3f}, {r['cpu_client']:.3f}"]
         for r in rows]))
    for r in rows:
        if r["errors"]:
            print(f"{r['streams']} streams: errors seen: {r['errors']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="32,256,1024",
                        help="concurrency levels on the simulator (comma-separated)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated step time")
    parser.add_argument("--sim-tokens", default="200-400", metavar="LO-HI",
                        help="output tokens per stream on the simulator, drawn from LO-HI "
                             "(64-64 at a 5-10 ms step is the default model's run at a "
                             "GPU's pace)")
    parser.add_argument("--real", type=int, default=0,
                        help="also the default model at this many streams (0: skip)")
    parser.add_argument("--real-tokens", type=int, default=64,
                        help="output tokens per stream with the default model")
    parser.add_argument("--real-device", default="auto", help="device of the default model")
    parser.add_argument("--real-dtype", default="auto", help="dtype of the default model")
    parser.add_argument("--core", choices=("thread", "process"), default="process",
                        help="where the worker runs its engine (KVOPS_ENGINE_CORE)")
    parser.add_argument("--database-url", default="",
                        help="a PostgreSQL server (postgres://user@host:port/any) to run the "
                             "stacks on, a fresh database each, instead of SQLite files")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per level, each the engine alone then a fresh stack: the "
                             "table shows the median run, and the ratios' range")
    parser.add_argument("--kv-history-blocks", type=int, default=None,
                        help="the engines' KV history (EngineConfig.kv_history_blocks; 0: no "
                             "KV stories); default: the engine's default")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds after which a stream counts as hung")
    parser.add_argument("--alone", choices=("thread", "process"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alone:
        _engine_alone_here(args.alone)
        return 0
    if args.repeat < 1:
        parser.error("--repeat must be 1 or more")
    try:
        args.sim_range = tuple(int(v) for v in args.sim_tokens.split("-"))
    except ValueError:
        args.sim_range = ()
    if len(args.sim_range) != 2 or not 1 <= args.sim_range[0] <= args.sim_range[1]:
        parser.error(f"--sim-tokens: LO-HI with 1 <= LO <= HI, not {args.sim_tokens!r}")
    levels = [int(s) for s in args.streams.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="kvops-bench-serve-") as tmp:
        redis = ensure_redis(os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0"),
                             Path(tmp))  # a private one if none answers
        try:
            rows = run_levels(args, levels, Path(tmp))
        finally:
            if redis is not None:
                redis.terminate()
    print()
    print_table(rows)
    return 1 if any(r["lost"] or r["hung"] for r in rows) else 0


def run_levels(args, levels: list[int], tmp: Path) -> list[dict]:
    rows = []
    for streams in levels:
        rows.append(bench_level(args, streams, False, tmp))
        print_table(rows[-1:])
        sys.stdout.flush()
    if args.real:
        rows.append(bench_level(args, args.real, True, tmp))
    return rows


def _exit_on_signal(signum, frame) -> None:
    # SIGTERM (a `timeout`, a CI job's end) or SIGHUP: leave through the `finally`s, which
    # stop this run's stacks and Redis. Their processes have sessions of their own, so a
    # signal to this one alone would leave them running (an engine worker, its core and the
    # model's memory) beside whatever runs next.
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    sys.exit(main())
