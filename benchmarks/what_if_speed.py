"""How fast is the what-if? `python -m benchmarks.what_if_speed [--minutes 60 --rate 3]`.

Builds an hour of one engine's traffic (multi-turn chats under a few shared system
prompts, Poisson arrivals at `--rate` jobs a second: about 10,800 jobs) and replays it
as the what-if replays one configuration (engine/sim/replay_stats.replay_stats, the
call kvops/what_if/what_if.py makes per configuration), under the engine's
configuration and under the GPU pool halved and doubled. Prints, per configuration, the
real seconds the replay took, the simulated seconds it covered, its steps and steps a
real second, and its prefix hit rate and TTFT. The target: under a minute a
configuration on the ops worker.

`--profile N`: instead, replay the engine's configuration under cProfile and print the
N functions with the most cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import platform
import pstats
import random
import resource
import sys
import time

from engine.config import EngineConfig
from engine.observe.step_cost import StepCost
from engine.sim.capacity import format_table
from engine.sim.replay_stats import replay_stats
from engine.sim.trace import TraceRequest

VOCAB = 32000
# A mid-sized engine as the simulator replays it (what_if.baseline_config's fields).
CONFIG = EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=VOCAB,
                      block_size=16, num_gpu_blocks=2048, num_cpu_blocks=1024,
                      max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                      max_pending_events=0)
# The paced simulator's fit in docs/benchmarks.md (the what-if against reality).
COST = StepCost(10.43, 0.203, 0.173)
LEVERS = {"engine's configuration": {}, "GPU blocks halved": {"num_gpu_blocks": 1024},
          "GPU blocks doubled": {"num_gpu_blocks": 4096}}


def hour_of_chat(minutes: float, rate: float, seed: int = 0,
                 systems: int = 4) -> tuple[list[TraceRequest], list[list[int]]]:
    """(trace, prompts): chats of up to 8 turns, each turn's prompt the chat so far (its
    system prompt, earlier turns and answers) and a new question; a new chat 30% of the
    time. Arrivals Poisson at `rate` a second for `minutes`."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(200, 400))]
                      for _ in range(systems)]
    chats: list[list[int]] = []
    trace, prompts, t = [], [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > minutes * 60:
            return trace, prompts
        open_chats = [c for c in chats if len(c) < CONFIG.max_model_len // 2]
        if not open_chats or rng.random() < 0.3:
            chats.append(list(rng.choice(system_prompts)))
            open_chats = [chats[-1]]
        chat = rng.choice(open_chats)
        chat += [rng.randrange(VOCAB) for _ in range(rng.randint(10, 80))]
        output = rng.randint(16, 200)
        trace.append(TraceRequest(t, len(chat), output))
        prompts.append(list(chat))
        chat += [rng.randrange(VOCAB) for _ in range(output)]  # the answer, in the next turn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.what_if_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=3.0, help="jobs a second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--levers", default=",".join(LEVERS),
                   help=f"comma-separated, of: {', '.join(LEVERS)}")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    args = p.parse_args(argv)
    before = _rss_mib()
    trace, prompts = hour_of_chat(args.minutes, args.rate, args.seed)
    print(f"trace: {len(trace)} jobs over {trace[-1].arrival_s / 60:.1f} min, "
          f"{sum(r.prompt_len for r in trace)} prompt and "
          f"{sum(r.output_len for r in trace)} output tokens, {_rss_mib() - before:.0f} MiB; "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(replay_stats, trace, CONFIG, COST, prompts)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
        return 0
    rows = []
    for name in args.levers.split(","):
        config = dataclasses.replace(CONFIG, **LEVERS[name])
        wall = time.perf_counter()
        stats = replay_stats(trace, config, COST, prompts)
        wall = time.perf_counter() - wall
        rows.append([name, str(config.num_gpu_blocks), f"{wall:.1f}",
                     f"{stats['sim_seconds']:.0f}", str(stats["steps"]),
                     f"{stats['steps'] / wall:.0f}", f"{100 * stats['prefix_hit_rate']:.1f}%",
                     f"{1000 * stats['ttft_p50']:.0f} ms", f"{1000 * stats['ttft_p99']:.0f} ms",
                     str(stats["preemptions"])])
        print(format_table(HEADER, rows[-1:]), flush=True)
    print()
    print(format_table(HEADER, rows))
    print(f"the process's peak memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


def _rss_mib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


HEADER = ["configuration", "GPU blocks", "replay s", "sim s", "steps", "steps/s",
          "prefix hit", "TTFT p50", "TTFT p99", "preempt"]

if __name__ == "__main__":
    sys.exit(main())
