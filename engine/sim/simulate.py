"""Capacity planner: replay a trace through the real scheduler and KV manager.

    python -m engine.sim.simulate --synthetic 500 --num-gpu-blocks 4096 --block-size 16
    python -m engine.sim.simulate --trace requests.csv --num-gpu-blocks 8192 --preemption-mode swap
    python -m engine.sim.simulate --synthetic 2000 --prefix-groups 200 --num-gpu-blocks 1024 \
        --cpu-cache-blocks 8192

Prints KV utilisation (token slots holding K/V / slots allocated), peak and mean
concurrency, preemptions, prefix-cache hit rate, and the same trace under contiguous
max-length reservation (what a server without paging must do) for comparison. With
--cpu-cache-blocks, the paged replay runs again with a CPU tier of that many blocks
behind the prefix cache (EngineConfig.cpu_prefix_cache), and the hit rates of both
runs are printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.observe.step_cost import StepCost
from engine.sim.capacity import HEADER, format_table, replay_contiguous, replay_paged
from engine.config import EngineConfig
from engine.sim.trace import load_trace, synthetic_trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.sim.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="CSV or JSONL: arrival_s, prompt_len, output_len"
                                     "[, prefix_group, prefix_len]")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=20.0, help="synthetic arrivals per second")
    p.add_argument("--prefix-groups", type=int, default=4,
                   help="synthetic: number of shared system prompts (half the requests use one)")
    p.add_argument("--prefix-len", type=int, default=256, help="synthetic: shared prompt tokens")
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--num-cpu-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--cpu-cache-blocks", type=int, default=None, metavar="N",
                   help="also replay with a CPU tier of N blocks behind the prefix cache")
    p.add_argument("--sliding-window", type=int, default=None, metavar="TOKENS",
                   help="every layer attends to this many last tokens (Mistral-style): "
                        "requests give back the blocks out of reach")
    p.add_argument("--hybrid", action="store_true",
                   help="with --sliding-window: as many global layers as sliding ones (Gemma "
                        "2): a block table per layer group, a block holding one group's "
                        "layers; also replays one table for every layer in the same memory "
                        "(half as many blocks)")
    p.add_argument("--step-base-ms", type=float, default=10.0, help="simulated step overhead")
    p.add_argument("--step-token-ms", type=float, default=0.05, help="simulated cost per token")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load_trace(args.trace) if args.trace else synthetic_trace(
            args.synthetic, seed=args.seed, rate_per_s=args.rate,
            prompt_range=(16, args.max_model_len // 2),
            output_range=(16, args.max_model_len // 4),
            num_prefix_groups=args.prefix_groups,
            prefix_len=min(args.prefix_len, args.max_model_len // 4))
        too_long = [r for r in trace if r.prompt_len >= args.max_model_len]
        if too_long:
            raise ValueError(f"{len(too_long)} requests have prompts of max_model_len "
                             f"({args.max_model_len}) tokens or more")
        if args.hybrid and args.sliding_window is None:
            raise ValueError("--hybrid needs --sliding-window")
        if args.hybrid and args.cpu_cache_blocks is not None:
            raise ValueError("--hybrid and --cpu-cache-blocks: a model with layer groups "
                             "keeps one table with the CPU tier on (not modelled here)")
        config = EngineConfig(
            simulate=True, simulate_tokenizer="bytes", vocab_size=32000,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            preemption_mode=args.preemption_mode,
            enable_prefix_caching=not args.no_prefix_caching, max_pending_events=0,
            simulate_sliding_window=args.sliding_window, simulate_hybrid=args.hybrid)
        one_table = None
        if args.hybrid:  # the same memory, every block holding both groups' layers
            one_table = dataclasses.replace(config, simulate_hybrid=False,
                                            simulate_sliding_window=None,
                                            num_gpu_blocks=args.num_gpu_blocks // 2)
        tiered = None
        if args.cpu_cache_blocks is not None:
            tiered = dataclasses.replace(config, num_cpu_blocks=args.cpu_cache_blocks,
                                         cpu_prefix_cache=True)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cost = StepCost(args.step_base_ms, args.step_token_ms)
    paged = replay_paged(trace, config, cost,
                         name="paged, a table per layer group" if args.hybrid else "paged")
    rows = [paged.row()]
    if one_table is not None:
        rows.append(replay_paged(trace, one_table, cost, name="paged, one table").row())
    if tiered is not None:
        with_tier = replay_paged(trace, tiered, cost, name="paged + CPU tier")
        rows.append(with_tier.row())
    # (hybrid: a token's K/V of both groups takes two blocks' slots)
    pool_tokens = args.num_gpu_blocks // (2 if args.hybrid else 1) * args.block_size
    contiguous = replay_contiguous(trace, pool_tokens,
                                   args.max_model_len, args.max_num_seqs,
                                   args.max_num_batched_tokens, cost,
                                   window=None if args.hybrid else args.sliding_window)
    print(f"trace: {len(trace)} requests, {sum(r.prompt_len for r in trace)} prompt tokens, "
          f"{sum(r.output_len for r in trace)} output tokens; pool: {args.num_gpu_blocks} "
          f"blocks x {args.block_size} tokens; max_model_len {args.max_model_len}")
    print(format_table(HEADER, rows + [contiguous.row()]))
    if tiered is not None:
        print(f"prefix hit rate: {100 * paged.prefix_hit_rate:.1f}% without the CPU tier, "
              f"{100 * with_tier.prefix_hit_rate:.1f}% with {args.cpu_cache_blocks} CPU blocks "
              f"({100 * with_tier.extra['cpu_hit_rate']:.1f}% of prompt tokens from the tier)")
    print(f"paged replay took {paged.wall_seconds:.1f} s of real time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
