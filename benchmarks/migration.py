"""The pause a client sees when its request moves to another engine:
`python -m benchmarks.migration`.

    python -m benchmarks.migration [--model sim|default] [--lengths 256,1024,4096,8192]
                                   [--step-ms 20] [--kv-bytes-per-token 32768]
    python -m benchmarks.migration --pd [--pd-requests 64] [--pd-rate 8]

Two engine cores, each in a process of its own (`python -m engine.serve.core_proc`, as a worker
runs them), this process their worker for both. For each context length a request is
started on the first core with a prompt of that many tokens; once it has made --before
tokens it is moved to the second (the "migrate" command, engine/transfer/link.py), and it
makes --after more there. The pause is what its client sees: the gap between the last
token that came from the first core and the first that came from the second, less the
normal gap between two tokens (the median before the move); and the longest gap between
two tokens at the first core while it copied (a staged copy's reads run between its
steps). Each length is moved twice,
by a staged copy (full blocks copied while it decodes, then a stop for the last few) and
by one stop-and-copy, and once more staged to a destination that already caches the
prompt (its blocks are not sent).

The simulator (--model sim, the default) paces its steps like a GPU (--step-ms per step,
--token-us per computed token) and carries --kv-bytes-per-token of K/V per token when a
request moves (32 KiB: a 1B-class model in bfloat16, e.g. 16 layers x 8 KV heads x 64 x
2 x 2 bytes); --model default runs the converted default model on this machine's CPU.

--pd measures prefill and decode on separate engines through the service (a throwaway
stack, /v1 streams from this process): a mix of long prompts with short answers and short
prompts with long answers arriving at a steady rate, on two simulated engines doing both
and on one prefill and one decode engine (KVOPS_ENGINE_ROLE), with the simulator's step
cost (--step-ms + --token-us per computed token: a long prompt's chunk holds up every
decode in its step when they share an engine).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from engine import keys, wire
from engine.transfer import ticket as move_ticket
from engine.config import EngineConfig
from engine.serve.core_proc import core_command

SECRET = keys.random_secret()  # the two cores' deployment secret (the service's, in one)


class CoreProcess:
    """An engine core in a process of its own; this process is its worker."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, folder: str) -> None:
        self.to_core = ctx.socket(zmq.PUSH)
        self.to_core.bind(f"ipc://{folder}/{config.name}-in")
        self.from_core = ctx.socket(zmq.PULL)
        self.from_core.bind(f"ipc://{folder}/{config.name}-out")
        argv, stdin = core_command(config, f"ipc://{folder}/{config.name}-in",
                                   f"ipc://{folder}/{config.name}-out", "--no-kv-view",
                                   "--nice", "0", "--log-level", "WARNING")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
        self.proc.stdin.write(stdin)
        self.proc.stdin.close()
        self.name = config.name
        ready = self.wait_for(lambda m: isinstance(m, wire.Ready), 900)
        self.described = ready.config
        self.address = self.described["migration_address"]
        self.arrivals: dict[str, list[tuple[float, int]]] = {}  # rid -> (time, tokens)
        self.replies: dict[int, wire.Reply | wire.Added] = {}
        self.ended: set[str] = set()

    def wait_for(self, match, timeout_s: float) -> wire.FromCore:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.from_core.poll(100):
                message = wire.FROM_CORE.decode(self.from_core.recv())
                if match(message):
                    return message
        raise TimeoutError("the engine core did not answer")

    def read(self) -> None:
        while True:
            try:
                message = wire.FROM_CORE.decode(self.from_core.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            now = time.perf_counter()
            if isinstance(message, wire.Outputs):
                for o in message.outputs:
                    if o.new_token_ids:
                        self.arrivals.setdefault(o.request_id, []).append(
                            (now, len(o.new_token_ids)))
                    if o.finished:
                        self.ended.add(o.request_id)
            elif isinstance(message, (wire.Reply, wire.Added)):
                self.replies[message.call_id] = message

    def send(self, message: wire.ToCore) -> None:
        self.to_core.send(wire.TO_CORE.encode(message))

    def close(self) -> None:
        self.send(wire.Shutdown())
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.to_core.close(linger=0)
        self.from_core.close(linger=0)


@dataclasses.dataclass
class Row:
    length: int
    how: str
    normal_ms: float
    gap_ms: float
    core_pause_ms: float
    copying_gap_ms: float  # the longest gap between two tokens at the source while it copied
    blocks_sent: int
    blocks_at_stop: int
    blocks_cached: int
    mib: float

    @property
    def pause_ms(self) -> float:
        return max(0.0, self.gap_ms - self.normal_ms)


def pump(cores, until, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        for core in cores:
            core.read()
        time.sleep(0.0005)


_calls = iter(range(1, 1 << 30))


def move_once(src: CoreProcess, dst: CoreProcess, rid: str, prompt: list[int], before: int,
              after: int, staged: bool) -> Row:
    params = {"max_tokens": before + after, "temperature": 0.0, "ignore_eos": True}
    call = next(_calls)
    src.send(wire.Adds(call, [wire.add_request(rid, prompt, params)]))
    pump([src, dst], lambda: call in src.replies)
    made = lambda core: sum(n for _, n in core.arrivals.get(rid, ()))  # noqa: E731
    pump([src, dst], lambda: made(src) >= before)
    call = next(_calls)
    asked = time.perf_counter()
    ticket = move_ticket.sign(SECRET, rid, None, src.name, dst.name, time.time() + 120)
    src.send(wire.Command(call, "migrate", {"request_id": rid, "address": dst.address,
                                            "to": dst.name, "staged": staged, "ticket": ticket},
                          time.time() + 120))
    pump([src, dst], lambda: call in src.replies)
    reply = src.replies[call]
    if reply.error is not None:
        raise RuntimeError(f"the move failed: {reply.error.type}: {reply.error.message}")
    result = reply.result
    pump([src, dst], lambda: rid in dst.ended)
    at_src = [t for t, _ in src.arrivals[rid]]
    at_dst = [t for t, _ in dst.arrivals[rid]]
    gaps = [b - a for a, b in zip(at_src[1:], at_src[2:])]  # (after the first token)
    normal = statistics.median(gaps) if gaps else 0.0
    copying = [b - a for a, b in zip(at_src, at_src[1:]) if b > asked]
    return Row(len(prompt), "staged" if staged else "stop-and-copy", 1000 * normal,
               1000 * (at_dst[0] - at_src[-1]), result["pause_ms"],
               1000 * max(copying, default=0.0), result["blocks_sent"],
               result["blocks_at_stop"], result["blocks_cached"], result["bytes_sent"] / 2**20)


def run(model: str, lengths: list[int], step_ms: float, token_us: float, kv_bytes: int,
        before: int, after: int, tcp: bool = False) -> list[Row]:
    longest = max(lengths) + before + after + 64
    # one machine's port (ipc://, K/V in the clear), or loopback TCP as between machines
    # (CurveZMQ encrypts every frame)
    common = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=2048,
                  enable_prefix_caching=True, migration_host="127.0.0.1" if tcp else "")
    if model == "sim":
        common.update(simulate=True, simulate_tokenizer="bytes", vocab_size=32000,
                      simulate_step_ms=step_ms, simulate_token_us=token_us,
                      simulate_kv_bytes_per_token=kv_bytes, max_model_len=longest,
                      num_gpu_blocks=2 * longest // 16 + 64, num_cpu_blocks=0)
        vocab = 32000
    else:  # (its own context limit: 8192 for the default model; longer prompts are cut)
        common.update(num_cpu_blocks=0)
        vocab = None
    folder = tempfile.mkdtemp(prefix="kvops-migration-bench-")
    ctx = zmq.Context()
    cores = []
    try:
        src = CoreProcess(EngineConfig(name="src", secret=SECRET, **common), ctx, folder)
        cores.append(src)
        dst = CoreProcess(EngineConfig(name="dst", secret=SECRET, **common), ctx, folder)
        cores.append(dst)
        vocab = vocab or src.described["vocab_size"]
        rng = random.Random(0)
        rows = []
        limit = src.described["max_model_len"] - before - after - 1
        for length in sorted({min(n, limit) for n in lengths}):
            for staged in (True, False):
                prompt = [rng.randrange(10, vocab - 10) for _ in range(length)]
                rows.append(move_once(src, dst, f"r{length}-{staged}", prompt, before, after,
                                      staged))
            # the destination caches the prompt already: its blocks are not sent
            prompt = [rng.randrange(10, vocab - 10) for _ in range(length)]
            call = next(_calls)
            dst.send(wire.Adds(call, [wire.add_request(f"warm{length}", prompt,
                                                       {"max_tokens": 1})]))
            pump(cores, lambda: f"warm{length}" in dst.ended)  # noqa: B023 (called here)
            row = move_once(src, dst, f"r{length}-cached", prompt, before, after, True)
            row.how = "staged, prompt cached there"
            rows.append(row)
        return rows
    finally:
        for core in cores:
            core.close()
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


# --- prefill and decode on separate engines, through the service -------------------------

PD_MODEL = "simulated-v1"


@dataclasses.dataclass
class PDWork:
    prompts: list[str]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after the start


def pd_workload(n: int, rate: float, long_prompt: int, seed: int = 0) -> PDWork:
    """Half the requests long prompts and short answers (`long_prompt` tokens in, 32 out),
    half short prompts and long answers (64 in, 256 out), in random order, arriving at
    `rate` a second (Poisson). The simulator's tokenizer counts bytes."""
    rng = random.Random(seed)
    kinds = [i % 2 for i in range(n)]
    rng.shuffle(kinds)
    prompts, max_tokens, arrivals, t = [], [], [], 0.0
    for i, kind in enumerate(kinds):
        size = long_prompt if kind == 0 else 64
        words = f"request {i}: " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(size))
        prompts.append(words[:size])
        max_tokens.append(32 if kind == 0 else 256)
        arrivals.append(t)
        t += rng.expovariate(rate)
    return PDWork(prompts, max_tokens, arrivals)


async def _pd_streams(url: str, token: str, work: PDWork, deadline_s: float):
    import asyncio

    from benchmarks.sse_client import stream_completion

    async def one(i: int):
        await asyncio.sleep(work.arrivals[i])
        body = {"model": PD_MODEL, "prompt": work.prompts[i], "max_tokens": work.max_tokens[i],
                "ignore_eos": True, "temperature": 0.0}
        return await stream_completion(url, token, body)

    tasks = [asyncio.create_task(one(i)) for i in range(len(work.prompts))]
    done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    return [t.result() if t in done else None for t in tasks]


def pd_run(roles: tuple[str, str], work: PDWork, engine: dict, folder) -> dict:
    import asyncio
    from pathlib import Path

    from benchmarks.bench_serve import pct
    from tests.support.stack import Stack
    stack = Stack(Path(folder))
    try:
        stack.start_web()
        for name, role in zip(("e1", "e2"), roles):
            stack.start_engine(name, threads=len(work.prompts) + 16, role=role, **engine)
        warm = PDWork(["warm up"], [4], [0.0])
        asyncio.run(_pd_streams(stack.url, stack.tokens["admin"], warm, 60))
        results = asyncio.run(_pd_streams(stack.url, stack.tokens["admin"], work, 600))
        ok = [r for r in results if r is not None and r.error is None and r.done]
        gaps = [g for r in ok for g in r.gaps]
        long_ok = [r for r, n in zip(results, work.max_tokens) if r in ok and n == 32]
        short_ok = [r for r, n in zip(results, work.max_tokens) if r in ok and n == 256]
        jobs = stack.api("GET", "/api/jobs/?limit=1000").json()["results"]
        handed = sum(len(j.get("engines") or []) > 1 for j in jobs)
        return {"roles": " + ".join(roles), "streams": len(ok), "lost": len(results) - len(ok),
                "ttft_p50": pct([r.ttft for r in ok if r.ttft is not None], 0.5),
                "ttft_long_p50": pct([r.ttft for r in long_ok if r.ttft is not None], 0.5),
                "gap_p50": pct(gaps, 0.5), "gap_p99": pct(gaps, 0.99),
                "gap_p99_long_answers": pct([g for r in short_ok for g in r.gaps], 0.99),
                "handed_over": handed}
    finally:
        stack.stop()


def pd_main(args) -> int:
    import os
    from pathlib import Path

    from kvops.infra.run import ensure_redis
    engine = dict(simulate=1, vocab_size=32000, block_size=16, num_gpu_blocks=8192,
                  num_cpu_blocks=0, max_num_seqs=64, max_num_batched_tokens=2048,
                  simulate_step_ms=args.step_ms, simulate_token_us=args.token_us,
                  simulate_kv_bytes_per_token=args.kv_bytes_per_token)
    work = pd_workload(args.pd_requests, args.pd_rate, args.pd_long_prompt)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvops-bench-pd-") as tmp:
        redis = ensure_redis(os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0"),
                             Path(tmp))
        try:
            for i, roles in enumerate((("both", "both"), ("prefill", "decode"))):
                folder = Path(tmp) / f"run{i}"
                folder.mkdir()
                rows.append(pd_run(roles, work, engine, folder))
        finally:
            if redis is not None:
                redis.terminate()
    print(f"Prefill/decode through the service: {args.pd_requests} streams at "
          f"{args.pd_rate:g}/s, half {args.pd_long_prompt}-token prompts with 32-token "
          f"answers, half 64-token prompts with 256-token answers; simulator, a step "
          f"{args.step_ms:g} ms + {args.token_us:g} us a computed token, chunks of 2048 "
          f"tokens, {args.kv_bytes_per_token} bytes of K/V a token")
    print("| engines | streams | lost | TTFT p50 s | TTFT p50, long prompts s | "
          "inter-chunk p50 ms | inter-chunk p99 ms | p99, long answers ms | handed over |")
    print("|" + "---|" * 9)
    for r in rows:
        print(f"| {r['roles']} | {r['streams']} | {r['lost']} | {r['ttft_p50']:.3f} | "
              f"{r['ttft_long_p50']:.3f} | {1000 * r['gap_p50']:.1f} | "
              f"{1000 * r['gap_p99']:.1f} | {1000 * r['gap_p99_long_answers']:.1f} | "
              f"{r['handed_over']} |")
    return 1 if any(r["lost"] for r in rows) else 0


def format_rows(rows: list[Row]) -> str:
    head = ("| context | copy | normal gap ms | client's pause ms | stop ms (core) | "
            "longest gap while copying ms | blocks sent | at the stop | cached there | "
            "MiB moved |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r.length} | {r.how} | {r.normal_ms:.1f} | {r.pause_ms:.1f} | "
                     f"{r.core_pause_ms:.1f} | {r.copying_gap_ms:.1f} | {r.blocks_sent} | "
                     f"{r.blocks_at_stop} | "
                     f"{r.blocks_cached} | {r.mib:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the pause of a request moved between engines")
    p.add_argument("--model", choices=("sim", "default"), default="sim")
    p.add_argument("--lengths", default="256,1024,4096,8192",
                   help="context lengths (prompt tokens), comma-separated")
    p.add_argument("--step-ms", type=float, default=20.0, help="sim: wall time of a step")
    p.add_argument("--token-us", type=float, default=10.0,
                   help="sim: and this much more per computed token")
    p.add_argument("--kv-bytes-per-token", type=int, default=32768,
                   help="sim: the K/V a token of the model it stands for weighs")
    p.add_argument("--before", type=int, default=16, help="tokens made before the move")
    p.add_argument("--after", type=int, default=64,
                   help="tokens made after it (the staged copy must end before them)")
    p.add_argument("--tcp", action="store_true",
                   help="move over loopback TCP with CurveZMQ, as between machines (default: "
                        "the one-machine port, a socket file)")
    p.add_argument("--pd", action="store_true",
                   help="instead: prefill/decode through the service, 1 prefill + 1 decode "
                        "engine against 2 engines doing both (simulator)")
    p.add_argument("--pd-requests", type=int, default=64)
    p.add_argument("--pd-rate", type=float, default=8.0, help="arrivals a second")
    p.add_argument("--pd-long-prompt", type=int, default=2048)
    args = p.parse_args(argv)
    if args.pd:
        return pd_main(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(args.model, lengths, args.step_ms, args.token_us, args.kv_bytes_per_token,
               args.before, args.after, args.tcp)
    what = (f"simulator, {args.step_ms:g} ms a step + {args.token_us:g} us a computed "
            f"token, {args.kv_bytes_per_token} bytes of K/V a token" if args.model == "sim"
            else "the default model on this machine's CPU")
    how = "loopback TCP, CurveZMQ" if args.tcp else "a socket file (ipc://)"
    print(f"Moving a request between two engine cores ({what}); blocks of 16 tokens; "
          f"over {how}")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
