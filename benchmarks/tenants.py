"""Two tenants on one engine: `python -m benchmarks.tenants`.

    python -m benchmarks.tenants [--seed 0] [--seeds 5] [--num-gpu-blocks 1024] [--burst 160]
                                 [--conversations 16] [--a-weight 4] [--max-num-batched-tokens 4096]
                                 [--num-cpu-blocks 0]

Tenant A runs a steady multi-turn chat: conversations that share one long system prompt,
each turn's prompt the whole history so far, the turns seconds apart. Tenant B, a few
seconds in, sends a burst of unique long prompts (nothing to share). The trace goes
through the real scheduler and KV core (capacity.replay_paged: the simulated model,
simulated time; a step costs --step-base-ms plus --step-token-ms per computed token and
--step-block-ms per block copied), once per configuration and seed (--seeds traces, from
--seed; A's times are pooled over them, so that its p99 is a percentile, not its slowest
request). --num-cpu-blocks: a CPU tier of that many blocks below the GPU pool
(EngineConfig.cpu_prefix_cache), which keeps the cached blocks the GPU pool lets go.
The configurations:

* A alone (the reference), and A alone in a pool of its quota's share (what the quota
  promises it);
* A and B with today's defaults: no quota, no share cap;
* a cache quota (EngineConfig.tenant_cache_quota, --quota): B's cached blocks over it go
  first, A's system prompt and histories stay;
* the share cap (max_batch_share 0.5) against token-weighted fairness (fairness "vtc");
* the quota and VTC together;
* VTC with A's weight (--a-weight, an operator's lever: `POST /api/engines/<name>/tenants/`).

Printed per run: A's prefix hit rate (prompt tokens served from the cache at first
admission, from any tier, / A's prompt tokens), A's time to first token (p50, p90, p99,
simulated; A sends 96 requests a trace), B's throughput (B's prompt and output tokens
over the time from its first arrival to its last token, summed over the traces) and B's
TTFT p50. Then the issue's targets: with the quota, A's hit rate within 5
points of A alone; with VTC, A's TTFT p99 within 2x of A alone, and B's throughput at
least 80% of the share cap's.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.observe.step_cost import StepCost
from engine.sim.capacity import replay_paged
from engine.sim.trace import TraceRequest

VOCAB = 32000


@dataclasses.dataclass
class Workload:
    trace: list[TraceRequest]
    prompts: list[list[int]]


def workload(seed: int, conversations: int, turns: int, system_len: int, burst: int,
             burst_len: int, burst_at_s: float) -> Workload:
    """A's conversations (one system prompt, histories growing by a message and a reply
    a turn) and B's burst, in arrival order."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(system_len)]
    rows: list[tuple[float, list[int], int, str]] = []
    for _ in range(conversations):
        t = rng.uniform(0.0, 20.0)  # conversations start over the first 20 s
        history = list(system)
        for _ in range(turns):
            history += [rng.randrange(VOCAB) for _ in range(rng.randint(48, 160))]
            output_len = rng.randint(32, 96)
            rows.append((t, list(history), output_len, "A"))
            history += [rng.randrange(VOCAB) for _ in range(output_len)]  # the reply
            t += rng.uniform(4.0, 10.0)  # the user reads and types
    for _ in range(burst):
        t = burst_at_s + rng.uniform(0.0, 2.0)
        rows.append((t, [rng.randrange(VOCAB) for _ in range(burst_len)], 128, "B"))
    rows.sort(key=lambda r: r[0])
    trace = [TraceRequest(t, len(p), out, tenant=tenant) for t, p, out, tenant in rows]
    return Workload(trace, [p for _, p, _, _ in rows])


@dataclasses.dataclass
class TenantRecorder:
    """A replay observer: per request, its tenant, arrival, first admission (tokens
    found cached), first token and end, in simulated seconds."""
    rows: dict[str, dict] = dataclasses.field(default_factory=dict)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)  # set at the start
    _open: dict = dataclasses.field(default_factory=dict)  # not ended yet: id -> Request

    def before_step(self, engine: LLMEngine, now: float) -> None:
        while self.weights:  # (as an operator sets them, before the first step)
            tenant, weight = self.weights.popitem()
            engine.set_tenant(tenant, weight=weight)
        for rid, request in engine.scheduler.requests.items():
            if rid not in self.rows:
                self.rows[rid] = {"tenant": request.tenant, "arrival": request.arrival_time,
                                  "prompt": request.num_prompt_tokens, "cached": None,
                                  "first_token": None, "end": None, "output": 0}
                self._open[rid] = request

    def after_step(self, engine: LLMEngine, now: float) -> None:
        for rid, request in list(self._open.items()):
            row = self.rows[rid]
            if row["cached"] is None and request.num_cached_tokens is not None:
                row["cached"] = request.num_cached_tokens
            if row["first_token"] is None and request.output_token_ids:
                row["first_token"] = now
            if request.status.is_finished:
                row["end"], row["output"] = now, len(request.output_token_ids)
                del self._open[rid]


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(runs: list[dict[str, dict]], system_len: int) -> dict:
    """Per tenant, over the runs' requests (one recorder's rows a run, a trace each): the
    requests pooled, B's throughput as its tokens over its spans, summed over the runs."""
    out = {}
    for tenant in ("A", "B"):
        mine = [r for rows in runs for r in rows.values() if r["tenant"] == tenant]
        if not mine:
            continue
        admitted = [r for r in mine if r["cached"] is not None]
        ttfts = [r["first_token"] - r["arrival"] for r in mine if r["first_token"] is not None]
        span = 0.0
        for rows in runs:
            one = [r for r in rows.values() if r["tenant"] == tenant]
            ended = [r["end"] for r in one if r["end"] is not None]
            span += max(ended) - min(r["arrival"] for r in one) if ended else 0.0
        tokens = sum(r["prompt"] + r["output"] for r in mine)
        out[tenant] = {
            "requests": len(mine),
            "hit_rate": sum(r["cached"] for r in admitted)
            / max(1, sum(r["prompt"] for r in admitted)),
            # admissions that found the whole system prompt cached (A's hot prefix)
            "kept_prefix": sum(r["cached"] >= system_len - 16 for r in admitted)
            / max(1, len(admitted)),
            "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p90": _p(ttfts, 0.90),
            "ttft_p99": _p(ttfts, 0.99),
            "tokens_per_s": tokens / span if span else 0.0,
        }
    return out


def run(loads: list[Workload], config: EngineConfig, cost: StepCost,
        tenants: tuple[str, ...], system_len: int,
        weights: dict[str, float] | None = None) -> dict:
    """Each trace replayed through its own engine; the summary of them all."""
    runs = []
    for load in loads:
        keep = [i for i, r in enumerate(load.trace) if r.tenant in tenants]
        recorder = TenantRecorder(weights=dict(weights or {}))
        replay_paged([load.trace[i] for i in keep], config, cost,
                     prompts=[load.prompts[i] for i in keep], observer=recorder)
        runs.append(recorder.rows)
    return summarise(runs, system_len)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--burst", type=int, default=160)
    ap.add_argument("--burst-len", type=int, default=2048)
    ap.add_argument("--burst-at-s", type=float, default=15.0)
    ap.add_argument("--num-gpu-blocks", type=int, default=1024)
    ap.add_argument("--num-cpu-blocks", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--quota", type=float, default=0.5)
    ap.add_argument("--a-weight", type=float, default=4.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--step-base-ms", type=float, default=10.0)
    ap.add_argument("--step-token-ms", type=float, default=0.05)
    # a block copied between the pools (a tier's load or store, a swap): a 16-token block
    # of a small model is a few hundred KB over PCIe, where computing it costs 0.8 ms
    ap.add_argument("--step-block-ms", type=float, default=0.05)
    args = ap.parse_args(argv)
    loads = [workload(seed, args.conversations, args.turns, args.system_len, args.burst,
                      args.burst_len, args.burst_at_s)
             for seed in range(args.seed, args.seed + args.seeds)]
    cost = StepCost(args.step_base_ms, args.step_token_ms, block_moved_ms=args.step_block_ms)
    base = EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=VOCAB,
                        block_size=16, num_gpu_blocks=args.num_gpu_blocks,
                        num_cpu_blocks=args.num_cpu_blocks,
                        cpu_prefix_cache=args.num_cpu_blocks > 0,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_history_blocks=0, name="tenants")
    in_share = f"A alone in {args.quota:g} of the pool"
    runs = [
        ("A alone", {}, ("A",)),
        # what the quota promises A: the cache a pool of its share would give it alone
        (in_share, {"num_gpu_blocks": int(args.quota * args.num_gpu_blocks)}, ("A",)),
        ("A + B, no quota", {}, ("A", "B")),
        (f"A + B, quota {args.quota:g}", {"tenant_cache_quota": args.quota}, ("A", "B")),
        ("A + B, share cap 0.5", {"max_batch_share": 0.5}, ("A", "B")),
        ("A + B, vtc", {"fairness": "vtc"}, ("A", "B")),
        (f"A + B, quota {args.quota:g} + vtc",
         {"tenant_cache_quota": args.quota, "fairness": "vtc"}, ("A", "B")),
        (f"A + B, vtc, A's weight {args.a_weight:g}", {"fairness": "vtc"}, ("A", "B"),
         {"A": args.a_weight}),
    ]
    tier = f", a CPU tier of {args.num_cpu_blocks}" if args.num_cpu_blocks else ""
    print(f"A: {args.conversations} conversations x {args.turns} turns, a "
          f"{args.system_len}-token system prompt; B: {args.burst} prompts of "
          f"{args.burst_len} tokens at {args.burst_at_s:g} s; {args.num_gpu_blocks} GPU "
          f"blocks of 16{tier}; {args.max_num_batched_tokens} tokens a step, a step "
          f"{args.step_base_ms:g} ms + {args.step_token_ms:g} ms/token + "
          f"{args.step_block_ms:g} ms/block copied (simulated time); {args.seeds} traces "
          f"(seeds {args.seed}-{args.seed + args.seeds - 1})\n")
    header = ("run", "A hit", "A prefix kept", "A TTFT p50", "A TTFT p90", "A TTFT p99", "B tok/s",
              "B TTFT p50")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = {}
    for name, overrides, tenants, *weights in runs:
        summary = run(loads, dataclasses.replace(base, **overrides), cost, tenants,
                      args.system_len, *weights)
        results[name] = summary
        a, b = summary["A"], summary.get("B")
        cells = [name, f"{100 * a['hit_rate']:.1f}%", f"{100 * a['kept_prefix']:.0f}%",
                 f"{1000 * a['ttft_p50']:.0f} ms", f"{1000 * a['ttft_p90']:.0f} ms",
                 f"{1000 * a['ttft_p99']:.0f} ms",
                 f"{b['tokens_per_s']:,.0f}" if b else "-",
                 f"{1000 * b['ttft_p50']:.0f} ms" if b else "-"]
        print("| " + " | ".join(cells) + " |")
    alone = results["A alone"]["A"]
    quota = results[f"A + B, quota {args.quota:g}"]
    vtc, share = results["A + B, vtc"], results["A + B, share cap 0.5"]
    print("\ntargets:")
    gap = 100 * (alone["hit_rate"] - quota["A"]["hit_rate"])
    print(f"  quota: A's hit rate {gap:+.1f} points under A alone (target: within 5) -> "
          f"{'met' if gap <= 5 else 'missed'}; "
          f"{100 * (results[in_share]['A']['hit_rate'] - quota['A']['hit_rate']):+.1f} under "
          "A alone in its quota's share of the pool")
    ratio = vtc["A"]["ttft_p99"] / alone["ttft_p99"]
    print(f"  vtc: A's TTFT p99 {ratio:.2f}x A alone's (target: within 2x) -> "
          f"{'met' if ratio <= 2 else 'missed'}")
    weighted = results[f"A + B, vtc, A's weight {args.a_weight:g}"]
    print(f"     with A's weight {args.a_weight:g}: "
          f"{weighted['A']['ttft_p99'] / alone['ttft_p99']:.2f}x, B's throughput "
          f"{100 * weighted['B']['tokens_per_s'] / share['B']['tokens_per_s']:.0f}% of the "
          "share cap's")
    share_ratio = vtc["B"]["tokens_per_s"] / share["B"]["tokens_per_s"]
    print(f"  vtc: B's throughput {100 * share_ratio:.0f}% of the share cap's (target: at "
          f"least 80%) -> {'met' if share_ratio >= 0.8 else 'missed'}")


if __name__ == "__main__":
    main()
