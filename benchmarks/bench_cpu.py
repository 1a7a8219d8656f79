"""Benchmark the CPU kernels (kernels/csrc, built by kernels.cpu_ext) against torch.

    python -m benchmarks.bench_cpu                   # every section
    python -m benchmarks.bench_cpu gemm              # packed_linear against torch.mm
    python -m benchmarks.bench_cpu gemm --rows 1 8   # only these row counts
    python -m benchmarks.bench_cpu attention         # the paged attention kernels (see
                                                  # benchmarks/bench_cpu_attention.py)
    python -m benchmarks.bench_cpu gemm --prefill    # and prefill's row counts, 256 .. 2048

gemm: the linear layers of a decode step of SmolLM2-135M (30 layers; qkv, o, gate_up
and down projections), run as one sweep over 30 distinct weight copies per shape, so
the weights come from L3/DRAM as in a real forward pass, not from L2. Columns: rows M
(tokens in the step); time of the sweep (fastest of --repeats) with torch.mm on the
[K, N] weights and with packed_linear on the packed ones; the GFLOP/s of each; the
speedup; the largest difference between the two outputs. Threads: torch's setting
(--threads overrides it).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks.bench_cpu_attention import add_attention_args, best_ms

# SmolLM2-135M's projections as [K, N] (weight_t): qkv, o, gate_up, down.
GEMM_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
GEMM_LAYERS = 30
GEMM_ROWS = (1, 4, 8, 16, 32, 48, 64, 128)
# A prefill's rows (the prompt's tokens): seconds per row count at 30 layers, hence an option.
GEMM_PREFILL_ROWS = (256, 512, 1024, 2048)


@dataclass(slots=True)
class GemmLayer:
    w_t: torch.Tensor  # [K, N] float32
    packed: torch.Tensor  # pack_weight(w_t)
    n: int


@dataclass(slots=True)
class GemmRow:
    rows: int
    mm_ms: float
    packed_ms: float
    flops: float  # of one sweep
    max_diff: float


def make_gemm_layers(ops, layers: int) -> list[GemmLayer]:
    gen = torch.Generator().manual_seed(0)
    result = []
    for _ in range(layers):
        for k, n in GEMM_SHAPES:
            w_t = torch.randn(k, n, generator=gen) * k**-0.5
            result.append(GemmLayer(w_t, ops.pack_weight(w_t), n))
    return result


def gemm_row(ops, layers: list[GemmLayer], rows: int, repeats: int) -> GemmRow:
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen) for k, _ in GEMM_SHAPES}

    def sweep_mm() -> list[torch.Tensor]:
        return [torch.mm(xs[layer.w_t.shape[0]], layer.w_t) for layer in layers]

    def sweep_packed() -> list[torch.Tensor]:
        return [ops.packed_linear(xs[layer.w_t.shape[0]], layer.packed, layer.n, None) for layer in layers]

    max_diff = max((a - b).abs().max().item() for a, b in zip(sweep_mm(), sweep_packed()))
    flops = sum(2.0 * rows * layer.w_t.numel() for layer in layers)
    return GemmRow(rows, best_ms(sweep_mm, repeats), best_ms(sweep_packed, repeats), flops, max_diff)


def print_gemm_table(rows: list[GemmRow], layers: int) -> None:
    weight_mb = sum(k * n for k, n in GEMM_SHAPES) * 4 * layers / 1e6
    print(f"gemm: {layers} layers x {len(GEMM_SHAPES)} shapes {list(GEMM_SHAPES)}, {weight_mb:.0f} MB of "
          f"float32 weights per sweep, {torch.get_num_threads()} threads")
    print(f"{'M':>5} {'mm ms':>9} {'packed ms':>10} {'mm GF/s':>8} {'packed GF/s':>12} {'speedup':>8} {'max diff':>9}")
    for row in rows:
        print(f"{row.rows:>5} {row.mm_ms:>9.2f} {row.packed_ms:>10.2f} {row.flops / row.mm_ms / 1e6:>8.1f} "
              f"{row.flops / row.packed_ms / 1e6:>12.1f} {row.mm_ms / row.packed_ms:>7.2f}x {row.max_diff:>9.1e}")


def run_gemm(args: argparse.Namespace) -> None:
    from kernels import cpu_ext

    ops = cpu_ext.ops()
    layers = make_gemm_layers(ops, args.layers)
    row_counts = list(args.rows) + (list(GEMM_PREFILL_ROWS) if args.prefill else [])
    print_gemm_table([gemm_row(ops, layers, rows, args.repeats) for rows in row_counts], args.layers)


def add_gemm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=list(GEMM_ROWS), help="row counts M to time")
    parser.add_argument("--prefill", action="store_true",
                        help=f"also time prefill's row counts {list(GEMM_PREFILL_ROWS)}")
    parser.add_argument("--layers", type=int, default=GEMM_LAYERS, help="distinct weight copies per shape")
    parser.add_argument("--repeats", type=int, default=7, help="timed sweeps per row count (the fastest counts)")
    parser.set_defaults(run=run_gemm)


# name -> (help, add its arguments); each section's arguments set `run`.
SECTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "gemm": ("packed_linear against torch.mm on a decode step's linear layers", add_gemm_args),
    "attention": ("the paged attention kernels against gather + SDPA on one step's attention",
                  add_attention_args),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing")
    subparsers = parser.add_subparsers(dest="section", metavar="SECTION")
    for name, (help_text, add_args) in SECTIONS.items():
        add_args(subparsers.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.section is not None:
        runs = [args]
    else:  # every section, with its default arguments
        runs = [subparsers.choices[name].parse_args([]) for name in SECTIONS]
    from kernels.cpu_ext import CpuKernelsUnavailable

    try:
        for run_args in runs:
            run_args.run(run_args)
            print()
    except CpuKernelsUnavailable as exc:
        print(f"cannot benchmark the CPU kernels, they did not build: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
