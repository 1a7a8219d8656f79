"""The prefix cache's tiers on multi-turn chat: `python -m benchmarks.tiers`.

    python -m benchmarks.tiers [--conversations 300] [--turns 4] [--num-gpu-blocks 1024]
                               [--model default [--device cpu] [--dtype float32]]

A few hundred conversations, each turn's prompt its whole history so far (the earlier
turns' prompts, a reply in their place, and a new message), the turns of one
conversation minutes apart with the others' in between: by the time a history comes
back, a GPU-only prefix cache has evicted it. The trace goes through the real scheduler
and KV core (`engine.capacity.replay_paged`, the simulated model, simulated time: a
step costs --step-base-ms plus --step-token-ms per computed token; copies from a tier
cost nothing in this model, which flatters the tiers a little; with --model, a real
model's forward passes run and its K/V is what the tiers carry, time still simulated), with:

* the GPU pool only;
* a CPU tier (`cpu_prefix_cache`, --num-cpu-blocks);
* a CPU tier and a disk tier (`disk_cache_dir`, --disk-gib); the disk tier alone,
  straight below the GPU pool;
* fp8 K/V in the same memory (the simulator: twice the blocks, as for a bf16 model; a
  real model: `kv_cache_dtype=fp8_e4m3`, as many times the blocks as its values' bytes);
* after a restart: an engine runs every turn but the conversations' last ones and stops
  (its disk tier spills what its CPU tier holds as it closes); a new engine takes the
  last turns with that disk tier (warm), or with none (cold). The disk takes a block
  only once it has been hit (`disk_cache_min_hits` 1, the default); with 0 it takes
  every block the CPU tier lets go, which a restart's first requests then find too.

Printed per run: the prefix hit rate, prompt tokens computed, the time to first token
(p50, p99, simulated), and where the hits came from. Then what sealing the disk tier's
files costs (engine/kv/tiers/disk_seal.py, AES-256-GCM; the CRC-32 it replaced beside it): MB/s
of one CPU core sealing and opening blocks of the default model's size, per K/V dtype
(`--seal-only`: that table alone). The replays' time is simulated: a tier's copies and
its sealing cost nothing in it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

from engine.observe.step_cost import StepCost
from engine.config import EngineConfig
from engine.sim.replay_stats import replay_stats
from engine.sim.trace import TraceRequest

VOCAB = 32000


@dataclasses.dataclass
class Workload:
    trace: list[TraceRequest]
    prompts: list[list[int]]
    last_turns: list[int]  # indices of every conversation's last turn


def multi_turn(conversations: int, turns: int, message: int, reply: int, gap_s: float,
               rate: float, seed: int = 0) -> Workload:
    """Conversations starting at `rate` a second; turn k+1 of one comes gap_s (+-50%)
    after turn k; each message `message` tokens, each reply `reply` tokens."""
    rng = random.Random(seed)
    events = []
    for c in range(conversations):
        history: list[int] = []
        at = c / rate
        for k in range(turns):
            history = history + [rng.randrange(3, VOCAB) for _ in range(message)]
            events.append((at, c, k, list(history)))
            history = history + [rng.randrange(3, VOCAB) for _ in range(reply)]
            at += gap_s * rng.uniform(0.5, 1.5)
    events.sort(key=lambda e: e[0])
    trace = [TraceRequest(arrival_s=at, prompt_len=len(p), output_len=reply)
             for at, _, _, p in events]
    last = [i for i, (_, _, k, _) in enumerate(events) if k == turns - 1]
    return Workload(trace, [p for *_, p in events], last)


def run(name: str, work: Workload, config: EngineConfig, cost: StepCost,
        indices: list[int] | None = None) -> dict:
    """One replay (of the requests at `indices`, or all), with its figures."""
    if indices is not None:
        trace = [work.trace[i] for i in indices]
        start = trace[0].arrival_s
        trace = [dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in trace]
        prompts = [work.prompts[i] for i in indices]
    else:
        trace, prompts = work.trace, work.prompts
    # (the replay's engine is closed at its end: a disk tier's writes are finished then)
    stats = replay_stats(trace, config, cost, prompts)
    return {"name": name, "requests": len(trace), "hit_rate": stats["prefix_lookup_hit_rate"],
            "computed": stats["prompt_tokens_computed"],
            "ttft_p50": stats["ttft_p50"], "ttft_p99": stats["ttft_p99"],
            "cpu_share": stats["cpu_tier_hit_rate"], "disk_share": stats["disk_tier_hit_rate"],
            "preemptions": stats["preemptions"]}


def model_value_bytes(config: EngineConfig) -> int:
    """Bytes of one K/V value of a real model's configuration (its dtype on its device)."""
    from engine.model.device import resolve_device, resolve_dtype

    return resolve_dtype(config.dtype, resolve_device(config.device)).itemsize


def fp8_of(config: EngineConfig, grow: int) -> EngineConfig:
    """The configuration with fp8 K/V in the same memory: `grow` times the blocks on the
    GPU and the CPU tier (a real model's disk budget is bytes already; the simulator's
    blocks weigh the same whatever they stand for, so its budget grows too)."""
    fields = dict(num_gpu_blocks=grow * config.num_gpu_blocks,
                  num_cpu_blocks=grow * config.num_cpu_blocks)
    if config.simulate:
        fields["disk_cache_bytes"] = grow * config.disk_cache_bytes
    else:
        fields["kv_cache_dtype"] = "fp8_e4m3"
    return dataclasses.replace(config, **fields)


def blocks_per_gib(block_size: int) -> str:
    """The default model's blocks per GiB by K/V dtype (when it has been converted)."""
    sizes = default_block_bytes(block_size)
    if not sizes:
        return ""
    return ("Blocks of " + str(block_size) + " tokens per GiB on the default model: "
            + ", ".join(f"{name} {2**30 // size:,}" for name, size in sizes.items()))


def default_block_bytes(block_size: int) -> dict[str, int]:
    """The default model's bytes a block by K/V dtype (when it has been converted)."""
    from engine.model.default_model import default_model_dir
    from engine.kv.layout import block_bytes, kv_layout
    from engine.model.loader import read_model_folder

    try:
        a = read_model_folder(default_model_dir()).args
    except Exception:  # noqa: BLE001  (not converted here: say nothing)
        return {}
    layout = kv_layout(a.layer_windows, a.n_layers)  # (as the runner lays it out)
    return {name: block_bytes(layout, block_size, a.n_kv_heads, a.head_dim, b)
            for name, b in (("float32", 4), ("bfloat16", 2), ("fp8", 1))}


def seal_rates(block_bytes: int, seconds: float = 1.0) -> dict[str, float]:
    """MB/s (10^6 bytes of K/V) of sealing and opening blocks of block_bytes on this
    thread, and of the CRC-32 the files had before."""
    from engine.kv.tiers.disk_seal import BlockSeal

    seal = BlockSeal(os.urandom(32), b"d" * 16)
    payload, block_hash = os.urandom(block_bytes), os.urandom(32)
    sealed = b"".join(seal.seal(0, block_hash, payload))

    def rate(work) -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            work()
            n += 1
        return n * block_bytes / (time.perf_counter() - start) / 1e6

    assert seal.open(0, block_hash, sealed) == payload
    return {"seal": rate(lambda: seal.seal(0, block_hash, payload)),
            "open": rate(lambda: seal.open(0, block_hash, sealed)),
            "crc32": rate(lambda: zlib.crc32(payload))}


def print_seal_costs(block_size: int) -> None:
    sizes = default_block_bytes(block_size) or {"the simulator's": block_size * 8}
    print(f"Sealing the disk tier's files (AES-256-GCM), one core, blocks of {block_size} "
          "tokens of the default model")
    print("| K/V dtype | block | seal MB/s | open MB/s | CRC-32 MB/s (before) | "
          "seal + open per block, ms |")
    print("|" + "---|" * 6)
    for name, size in sizes.items():
        r = seal_rates(size)
        per_block = size / 1e6 * (1 / r["seal"] + 1 / r["open"]) * 1e3
        print(f"| {name} | {size // 1024} KiB | {r['seal']:,.0f} | {r['open']:,.0f} | "
              f"{r['crc32']:,.0f} | {per_block:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the prefix cache's tiers on multi-turn chat")
    p.add_argument("--conversations", type=int, default=300)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--message", type=int, default=200, help="tokens of each user message")
    p.add_argument("--reply", type=int, default=100, help="tokens of each reply")
    p.add_argument("--gap-s", type=float, default=180.0,
                   help="seconds between two turns of a conversation (+-50%%)")
    p.add_argument("--rate", type=float, default=2.0, help="conversations started a second")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--num-cpu-blocks", type=int, default=2048)
    p.add_argument("--disk-gib", type=float, default=1.0)
    p.add_argument("--step-base-ms", type=float, default=10.0)
    p.add_argument("--step-token-ms", type=float, default=0.05)
    p.add_argument("--model", default=None,
                   help="a real model instead of the simulator: `default` or an HF folder "
                        "(its forward passes run; time is still simulated)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seal-only", action="store_true",
                   help="only what sealing the disk tier's files costs")
    args = p.parse_args(argv)
    if args.seal_only:
        print_seal_costs(args.block_size)
        return 0
    work = multi_turn(args.conversations, args.turns, args.message, args.reply, args.gap_s,
                      args.rate)
    cost = StepCost(args.step_base_ms, args.step_token_ms)
    longest = max(len(pr) for pr in work.prompts) + args.reply + args.block_size
    common = dict(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                  num_cpu_blocks=0, max_model_len=longest, max_num_seqs=64,
                  max_num_batched_tokens=2048, kv_history_blocks=0, max_pending_events=0)
    if args.model is None:
        base = EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=VOCAB,
                            **common)
    else:
        base = EngineConfig(model=None if args.model == "default" else args.model,
                            device=args.device, dtype=args.dtype, **common)
    cpu = dataclasses.replace(base, num_cpu_blocks=args.num_cpu_blocks, cpu_prefix_cache=True)
    folder = Path(tempfile.mkdtemp(prefix="kvops-bench-tiers-"))
    try:
        def with_disk(name: str, min_hits: int = 1):
            return dataclasses.replace(cpu, disk_cache_dir=str(folder / name),
                                       disk_cache_bytes=int(args.disk_gib * 2**30),
                                       disk_cache_min_hits=min_hits)
        last = set(work.last_turns)
        earlier = [i for i in range(len(work.trace)) if i not in last]
        rows = [run("GPU only", work, base, cost), run("GPU + CPU", work, cpu, cost),
                run("GPU + CPU + disk", work, with_disk("all"), cost),
                run("GPU + disk (no CPU tier: the disk below the GPU)", work,
                    dataclasses.replace(with_disk("direct"), cpu_prefix_cache=False,
                                        num_cpu_blocks=0), cost)]
        # fp8 K/V: the same memory holds as many times the blocks as the model's values
        # are bytes, on every tier (the simulator stands for a bf16 model: 2x)
        grow = 2 if base.simulate else model_value_bytes(base)
        label = f"fp8 K/V (the same memory: {grow}x blocks)"
        rows += [run(f"GPU only, {label}", work, fp8_of(base, grow), cost),
                 run(f"GPU + CPU + disk, {label}", work, fp8_of(with_disk("fp8"), grow), cost)]
        # A restart before the last turns: an engine ran the earlier turns and stopped
        # (its disk tier spilled what its CPU tier held); a new one takes the last turns
        run("earlier turns", work, with_disk("restart"), cost, earlier)
        run("earlier turns", work, with_disk("restart-all", 0), cost, earlier)
        rows += [run("after a restart, warm disk", work, with_disk("restart"), cost,
                     work.last_turns),
                 run("after a restart, warm disk of every block (min hits 0)", work,
                     with_disk("restart-all", 0), cost, work.last_turns),
                 run("after a restart, cold (no disk)", work, cpu, cost, work.last_turns)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    what = "the simulator" if base.simulate else f"the model {args.model} ({model_value_bytes(base)}-byte values)"
    print(f"On {what}. Multi-turn chat: {args.conversations} conversations x {args.turns} turns "
          f"({args.message}-token messages, {args.reply}-token replies, turns "
          f"{args.gap_s:g} s +-50% apart); {args.num_gpu_blocks} GPU blocks of "
          f"{args.block_size}, {args.num_cpu_blocks} CPU blocks, {args.disk_gib:g} GiB of "
          f"disk; a step {args.step_base_ms:g} ms + {args.step_token_ms:g} ms a computed "
          "token (simulated time)")
    per_gib = blocks_per_gib(args.block_size)
    if per_gib:
        print(per_gib)
    print("| cache | requests | prefix hit rate | of it from CPU | of it from disk | prompt "
          "tokens computed | TTFT p50 s | TTFT p99 s | preemptions |")
    print("|" + "---|" * 9)
    for r in rows:
        print(f"| {r['name']} | {r['requests']} | {100 * r['hit_rate']:.1f}% | "
              f"{100 * r['cpu_share']:.1f}% | {100 * r['disk_share']:.1f}% | {r['computed']:,} | "
              f"{r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['preemptions']} |")
    print()
    print_seal_costs(args.block_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
