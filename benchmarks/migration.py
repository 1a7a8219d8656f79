"""The pause a client sees when its request moves to another engine:
`python -m benchmarks.migration`.

    python -m benchmarks.migration [--model sim|default] [--lengths 256,1024,4096,8192]
                                   [--step-ms 20] [--kv-bytes-per-token 32768]

Two engine cores, each in a process of its own (`python -m engine.core_proc`, as a worker
runs them), this process their worker for both. For each context length a request is
started on the first core with a prompt of that many tokens; once it has made --before
tokens it is moved to the second (the "migrate" command, engine/migration_link.py), and it
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
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from engine.config import EngineConfig
from engine.core_proc import pack, unpack


class CoreProcess:
    """An engine core in a process of its own; this process is its worker."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, folder: str) -> None:
        self.to_core = ctx.socket(zmq.PUSH)
        self.to_core.bind(f"ipc://{folder}/{config.name}-in")
        self.from_core = ctx.socket(zmq.PULL)
        self.from_core.bind(f"ipc://{folder}/{config.name}-out")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        self.proc = subprocess.Popen([
            sys.executable, "-m", "engine.core_proc", "--config", json.dumps(fields),
            "--input", f"ipc://{folder}/{config.name}-in",
            "--output", f"ipc://{folder}/{config.name}-out", "--no-kv-view", "--nice", "0",
            "--log-level", "WARNING"])
        ready = self.wait_for(lambda m: m[0] == "ready", 900)
        self.described = ready[1]
        self.address = self.described["migration_address"]
        self.arrivals: dict[str, list[tuple[float, int]]] = {}  # rid -> (time, tokens)
        self.replies: dict[int, list] = {}
        self.ended: set[str] = set()

    def wait_for(self, match, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.from_core.poll(100):
                message = unpack(self.from_core.recv())
                if match(message):
                    return message
        raise TimeoutError("the engine core did not answer")

    def read(self) -> None:
        while True:
            try:
                message = unpack(self.from_core.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            now = time.perf_counter()
            if message[0] == "out":
                for row in message[1]:
                    rid, new, finished = row[0], row[1], row[2]
                    if new:
                        self.arrivals.setdefault(rid, []).append((now, len(new)))
                    if finished:
                        self.ended.add(rid)
            elif message[0] == "reply":
                self.replies[message[1]] = message[2:]

    def send(self, message: list) -> None:
        self.to_core.send(pack(message))

    def close(self) -> None:
        self.send(["shutdown"])
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
    src.send(["adds", call, [[rid, prompt, params, 0, None, None, None]]])
    pump([src, dst], lambda: call in src.replies)
    made = lambda core: sum(n for _, n in core.arrivals.get(rid, ()))  # noqa: E731
    pump([src, dst], lambda: made(src) >= before)
    call = next(_calls)
    asked = time.perf_counter()
    src.send(["cmd", call, "migrate", {"request_id": rid, "address": dst.address, "to": "dst",
                                       "staged": staged}, time.time() + 120])
    pump([src, dst], lambda: call in src.replies)
    ok, result = src.replies[call]
    if not ok:
        raise RuntimeError(f"the move failed: {result}")
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
        before: int, after: int) -> list[Row]:
    longest = max(lengths) + before + after + 64
    common = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=2048,
                  enable_prefix_caching=True)
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
        src = CoreProcess(EngineConfig(name="src", **common), ctx, folder)
        cores.append(src)
        dst = CoreProcess(EngineConfig(name="dst", **common), ctx, folder)
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
            dst.send(["adds", call, [[f"warm{length}", prompt, {"max_tokens": 1}, 0, None,
                                      None, None]]])
            pump(cores, lambda: f"warm{length}" in dst.ended)
            row = move_once(src, dst, f"r{length}-cached", prompt, before, after, True)
            row.how = "staged, prompt cached there"
            rows.append(row)
        return rows
    finally:
        for core in cores:
            core.close()
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


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
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(args.model, lengths, args.step_ms, args.token_us, args.kv_bytes_per_token,
               args.before, args.after)
    what = (f"simulator, {args.step_ms:g} ms a step + {args.token_us:g} us a computed "
            f"token, {args.kv_bytes_per_token} bytes of K/V a token" if args.model == "sim"
            else "the default model on this machine's CPU")
    print(f"Moving a request between two engine cores ({what}); blocks of 16 tokens")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
