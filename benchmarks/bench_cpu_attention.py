"""The `attention` section of `python -m benchmarks.bench_cpu`: the C++ kernels as the
engine plans them (kvops::paged_decode_attention for decodes, paged_prefill_attention
for prompts) against the torch path of kernels/cpu_attention.py (gather + SDPA, grouped
decodes) on one step's attention over every layer; for prompts also
paged_decode_attention taking them one row at a time.

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64, 30 layers, blocks
of 16); each layer has its own cache, scattered over the pool, so K/V come from memory
as in a real step. Decode rows: n sequences with one new token each; prefill rows: n
prompts of the given length, all new. Columns: time of the step's attention (fastest
of --repeats) for each path, the K/V bytes the step reads at least once and the rate
the kernel reads them at, the largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.cpu_attention import paged_attention, plan_attention

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
# (kind, sequences, context length): decode batches of a serving step, then prefills
CASES = (("decode", 8, 256), ("decode", 32, 256), ("decode", 32, 1024), ("decode", 128, 512),
         ("prefill", 16, 32), ("prefill", 8, 128), ("prefill", 4, 512))
QUICK_CASES = (("decode", 4, 40), ("prefill", 2, 24))  # 24 >= NATIVE_CHUNK_MIN_ROWS  # --quick: a smoke run


@dataclass(slots=True)
class AttentionRow:
    kind: str
    seqs: int
    context: int
    native_ms: float
    torch_ms: float
    rows_ms: float | None  # prompts: paged_decode_attention, one row at a time
    kv_bytes: int  # K/V bytes of the contexts, over all layers
    max_diff: float


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls in milliseconds, after one warm-up call. The fastest,
    not the median: on a 2-core machine anything else running (a compiler, a profiler)
    stalls the whole sweep, and the fastest sweep is the one it disturbed least."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def attention_row(kind: str, seqs: int, context: int, repeats: int) -> AttentionRow:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(seqs * 7919 + context)
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
              for _ in range(LAYERS)]
    order = list(range(num_blocks))
    random.Random(context).shuffle(order)
    tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(seqs)]
    q_len = 1 if kind == "decode" else context
    qsl = [i * q_len for i in range(seqs + 1)]
    q = torch.randn(qsl[-1], Q_HEADS, HEAD_DIM, generator=gen)
    lens = [context] * seqs
    plans = {"native": plan_attention(tables, lens, qsl, BLOCK_SIZE, native=True),
             "torch": plan_attention(tables, lens, qsl, BLOCK_SIZE),
             "rows": plan_attention(tables, lens, qsl, BLOCK_SIZE, native=True,
                                    chunk_min_rows=q_len + 1)}
    scale = HEAD_DIM ** -0.5

    def step(path: str) -> list[torch.Tensor]:
        return [paged_attention(q, kv[0], kv[1], plans[path], scale) for kv in caches]

    torch_out = step("torch")
    max_diff = max((a - b).abs().max().item() for path in ("native", "rows")
                   for a, b in zip(step(path), torch_out))
    kv_bytes = LAYERS * seqs * context * 2 * KV_HEADS * HEAD_DIM * 4
    return AttentionRow(kind, seqs, context, best_ms(lambda: step("native"), repeats),
                        best_ms(lambda: step("torch"), repeats),
                        best_ms(lambda: step("rows"), repeats) if q_len > 1 else None,
                        kv_bytes, max_diff)


def print_attention_table(rows: list[AttentionRow]) -> None:
    print(f"attention: {LAYERS} layers, {Q_HEADS} q heads / {KV_HEADS} kv heads x {HEAD_DIM}, "
          f"blocks of {BLOCK_SIZE}, float32, {torch.get_num_threads()} threads")
    print(f"{'rows':>8} {'seqs':>5} {'context':>8} {'kernel ms':>10} {'torch ms':>9} "
          f"{'speedup':>8} {'row by row ms':>14} {'KV MB':>7} {'kernel GB/s':>12} {'max diff':>9}")
    for r in rows:
        by_row = "-" if r.rows_ms is None else f"{r.rows_ms:.2f}"
        print(f"{r.kind:>8} {r.seqs:>5} {r.context:>8} {r.native_ms:>10.2f} {r.torch_ms:>9.2f} "
              f"{r.torch_ms / r.native_ms:>7.2f}x {by_row:>14} {r.kv_bytes / 1e6:>7.0f} "
              f"{r.kv_bytes / r.native_ms / 1e6:>12.1f} {r.max_diff:>9.1e}")


def run_attention(args: argparse.Namespace) -> None:
    from kernels import cpu_ext

    cpu_ext.ops()  # builds the kernels, or raises CpuKernelsUnavailable
    print_attention_table([attention_row(kind, seqs, context, args.repeats)
                           for kind, seqs, context in (QUICK_CASES if args.quick else CASES)])


def add_attention_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per case (the fastest counts)")
    parser.add_argument("--quick", action="store_true", help="two tiny cases (a smoke run)")
    parser.set_defaults(run=run_attention)
