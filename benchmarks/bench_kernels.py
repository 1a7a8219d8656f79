"""Benchmark paged_attention against SDPA on the same data laid out contiguously, and
the fused gate/up projection + activation against cuBLAS's matmul + gated_act.

    python -m benchmarks.bench_kernels                  # CUDA: decode, prefill and gated MLP tables
    python -m benchmarks.bench_kernels --quick          # CUDA: fewer shapes
    python -m benchmarks.bench_kernels --cpu-interpret  # no GPU: tiny smoke run in Triton's interpreter

Shapes are Llama-8B-like: 32 query / 8 KV heads, head_dim 128, bf16, block size 16.
Columns: time per call (median); bytes a perfect kernel must move (K/V of every
context once, plus q and out) divided by the time, also as a fraction of the copy
bandwidth measured here with a large tensor copy; for prefill the attention
TFLOP/s; the ratio to torch.nn.functional.scaled_dot_product_attention on
contiguous K/V (the no-paging baseline; > 1 means paged is slower); and the largest
difference between the two outputs. Chunk rows give SDPA an explicit bottom-right
causal mask, which can move it to a slower backend than a plain causal prefill.

The gated MLP table (CUDA only) times kernels.gate_up_act, the gate/up projection and
the activation in one launch, against torch.mm then kernels.gated_act (what TritonOps
runs past its row bound), for the default model's MLP (dim 576, intermediate 1536,
bf16) at decode batch sizes: time per call (median) of each, their ratio (< 1 means the
fused kernel is faster), the fused kernel's weight + activation bytes over its time,
and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MLP_DIM, MLP_INTERMEDIATE, MLP_ROWS = 576, 1536, (1, 32, 256)  # SmolLM2-135M's MLP


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # "decode" | "prefill" | "chunk" (prefill chunk after a cached prefix)
    batch: int
    context: int  # seq_len of every sequence, new tokens included
    new_tokens: int  # query tokens per sequence


@dataclass(slots=True)
class Row:
    case: Case
    splits: int
    paged_ms: float
    sdpa_ms: float
    gbytes_per_s: float
    copy_fraction: float
    tflops: float
    max_diff: float


def decode_cases(quick: bool) -> list[Case]:
    batches = [1, 16, 256] if quick else [1, 4, 16, 64, 256]
    contexts = [512, 8192, 32768] if quick else [512, 2048, 8192, 32768]
    return [Case("decode", b, c, 1) for b in batches for c in contexts]


def prefill_cases(quick: bool) -> list[Case]:
    cases = [Case("prefill", 1, 2048, 2048), Case("prefill", 4, 2048, 2048), Case("chunk", 1, 8192, 512)]
    if not quick:
        cases += [Case("prefill", 1, 512, 512), Case("prefill", 1, 8192, 8192), Case("prefill", 16, 1024, 1024),
                  Case("chunk", 4, 4096, 1024)]
    return cases


def interpreter_cases() -> list[Case]:
    return [Case("decode", 2, 100, 1), Case("prefill", 1, 32, 32), Case("chunk", 1, 64, 16)]


def measure(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # the interpreter compiles nothing, but the first call imports and builds
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def fits_in_memory(case: Case, dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    kv_bytes = case.batch * case.context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize * 2
    free, _ = torch.cuda.mem_get_info(device)
    return 3 * kv_bytes < 0.8 * free  # paged cache, per-sequence copies, contiguous SDPA copy


def sdpa_inputs(batch, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [B, Hq, Lq, D], k and v [B, Hkv, L, D] contiguous, and the bottom-right causal
    mask for chunks (None: plain causal prefill, or a decode that sees everything)."""
    q = batch.q.view(case.batch, case.new_tokens, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    k = batch.q.new_empty(case.batch, NUM_KV_HEADS, case.context, HEAD_DIM)
    v = torch.empty_like(k)
    for s in range(case.batch):  # one sequence at a time: no second full-size temporary
        k[s] = batch.keys[s].transpose(0, 1)
        v[s] = batch.values[s].transpose(0, 1)
    mask = None
    if case.kind == "chunk":
        mask = torch.ones(case.new_tokens, case.context, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=case.context - case.new_tokens)
    return q, k, v, mask


def run_case(case: Case, dtype: torch.dtype, device: torch.device, copy_bytes_per_s: float) -> Row:
    from kernels import paged_attention
    from kernels.paged_attention_plan import plan_launch
    from kernels.testing import make_paged_batch

    batch = make_paged_batch([case.context] * case.batch, [case.new_tokens] * case.batch, NUM_Q_HEADS,
                             NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, device, fill_unused_with_nan=False)
    q, k, v, mask = sdpa_inputs(batch, case)
    batch.keys, batch.values = [], []  # the contiguous copies above are all SDPA needs

    def paged() -> torch.Tensor:
        return paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.block_tables,
                               batch.seq_lens, batch.query_start_loc, batch.scale,
                               max_seq_len=case.context, max_query_len=case.new_tokens)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=case.kind == "prefill", scale=batch.scale, enable_gqa=True)

    paged_ms, sdpa_ms = measure(paged, device), measure(sdpa, device)
    diff = (paged().float() - sdpa().transpose(1, 2).reshape_as(batch.q).float()).abs().max().item()
    plan = plan_launch(batch.q, batch.key_cache, batch.block_tables, max_seq_len=case.context,
                       max_query_len=case.new_tokens)

    element = dtype.itemsize
    kv_bytes = case.batch * case.context * NUM_KV_HEADS * HEAD_DIM * element * 2
    qo_bytes = 2 * batch.q.numel() * element
    bytes_per_s = (kv_bytes + qo_bytes) / (paged_ms * 1e-3)
    cached = case.context - case.new_tokens
    visible_pairs = case.new_tokens * cached + case.new_tokens * (case.new_tokens + 1) // 2
    flops = 4 * case.batch * NUM_Q_HEADS * HEAD_DIM * visible_pairs
    return Row(case, plan.num_splits, paged_ms, sdpa_ms, bytes_per_s / 1e9, bytes_per_s / copy_bytes_per_s,
               flops / (paged_ms * 1e-3) / 1e12, diff)


@dataclass(slots=True)
class GateUpRow:
    rows: int
    fused_ms: float
    unfused_ms: float  # torch.mm, then gated_act
    gbytes_per_s: float  # the fused kernel's bytes (weight, x, out) over its time
    max_diff: float


def run_gate_up(rows: int, dtype: torch.dtype, device: torch.device) -> GateUpRow:
    from kernels.gate_up_act import gate_up_act
    from kernels.gated_act import gated_act

    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, MLP_DIM, generator=gen, device=device).to(dtype)
    weight_t = (torch.randn(MLP_DIM, 2 * MLP_INTERMEDIATE, generator=gen, device=device)
                * MLP_DIM ** -0.5).to(dtype)

    def fused() -> torch.Tensor:
        return gate_up_act(x, weight_t, None, "silu")

    def unfused() -> torch.Tensor:
        return gated_act(torch.mm(x, weight_t), "silu")

    fused_ms, unfused_ms = measure(fused, device), measure(unfused, device)
    diff = (fused().float() - unfused().float()).abs().max().item()
    nbytes = (weight_t.numel() + x.numel() + rows * MLP_INTERMEDIATE) * dtype.itemsize
    return GateUpRow(rows, fused_ms, unfused_ms, nbytes / (fused_ms * 1e-3) / 1e9, diff)


def print_gate_up_table(rows: list[GateUpRow], dtype: torch.dtype) -> None:
    print(f"\ngated MLP: dim {MLP_DIM}, intermediate {MLP_INTERMEDIATE}, {dtype}, silu")
    print(f"{'rows':>6}{'fused ms':>10}{'mm+act ms':>11}{'fused/mm+act':>14}{'GB/s':>8}{'max diff':>10}")
    for row in rows:
        print(f"{row.rows:>6}{row.fused_ms:>10.4f}{row.unfused_ms:>11.4f}"
              f"{row.fused_ms / row.unfused_ms:>14.2f}{row.gbytes_per_s:>8.0f}{row.max_diff:>10.1e}")


def print_table(title: str, rows: list[Row | Case]) -> None:
    print(f"\n{title}")
    print(f"{'kind':<8}{'batch':>6}{'context':>8}{'q/seq':>7}{'splits':>7}{'paged ms':>10}{'sdpa ms':>10}"
          f"{'paged/sdpa':>11}{'GB/s':>8}{'of copy':>9}{'TFLOP/s':>9}{'max diff':>10}")
    for row in rows:
        if isinstance(row, Case):
            print(f"{row.kind:<8}{row.batch:>6}{row.context:>8}{row.new_tokens:>7}   skipped: not enough GPU memory")
            continue
        c = row.case
        print(f"{c.kind:<8}{c.batch:>6}{c.context:>8}{c.new_tokens:>7}{row.splits:>7}{row.paged_ms:>10.3f}"
              f"{row.sdpa_ms:>10.3f}{row.paged_ms / row.sdpa_ms:>11.2f}{row.gbytes_per_s:>8.0f}"
              f"{row.copy_fraction:>9.0%}{row.tflops:>9.1f}{row.max_diff:>10.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark paged_attention against SDPA.")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--cpu-interpret", action="store_true",
                        help="no GPU: tiny shapes in Triton's CPU interpreter (a smoke run; timings mean nothing)")
    args = parser.parse_args(argv)

    if args.cpu_interpret:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("benchmarks.bench_kernels: Triton was already imported outside interpreter mode; run in a fresh process")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before the first launch imports Triton
        device = torch.device("cpu")
        decode = [c for c in interpreter_cases() if c.kind == "decode"]
        prefill = [c for c in interpreter_cases() if c.kind != "decode"]
    elif not torch.cuda.is_available():
        print("benchmarks.bench_kernels needs a CUDA GPU and found none; nothing to measure. "
              "`python -m benchmarks.bench_kernels --cpu-interpret` runs a tiny smoke test in Triton's interpreter.")
        return 0
    else:
        device = torch.device("cuda")
        decode, prefill = decode_cases(args.quick), prefill_cases(args.quick)

    dtype = torch.bfloat16
    copy_bytes_per_s = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}; copy bandwidth {copy_bytes_per_s / 1e9:.0f} GB/s; "
          f"{NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, {dtype}, block size {BLOCK_SIZE}")
    for title, cases in (("decode", decode), ("prefill", prefill)):
        rows: list[Row | Case] = []
        for case in cases:
            if not fits_in_memory(case, dtype, device):
                rows.append(case)
                continue
            rows.append(run_case(case, dtype, device, copy_bytes_per_s))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print_table(title, rows)
    if device.type == "cuda":  # the interpreter's timings of a GEMM would say nothing
        print_gate_up_table([run_gate_up(rows, dtype, device) for rows in MLP_ROWS], dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
