"""Is the what-if right? `python -m benchmarks.what_if_fidelity [--requests 240]`.

On a throwaway deployment (web server, ops worker, simulated engines paced like a GPU:
KVOPS_ENGINE_SIMULATE_STEP_MS and _TOKEN_US), it records a workload on one engine:
multi-turn chats under a few shared system prompts, arriving over a minute or more. It
asks the what-if to replay that window under the engine's own configuration (the
baseline, held against what the engine recorded) and under each lever: the GPU pool
halved and doubled, the CPU tier on, the disk tier on, each eviction policy,
max_num_seqs halved, a pin budget of 0. Then it runs the same trace (the same prompts,
output lengths and arrival times) live on a fresh engine configured that way, and
prints what the what-if predicted against what the live engine measured: prefix hit
rate, TTFT p50 (from the job's arrival to its first token, as a user sees it) and
preemptions. (fp8 K/V is a real model's lever: a simulated engine refuses it.)

`--model default` records and reruns on the default model instead (on this machine's
device, float32 on a CPU), with its levers: the GPU pool halved and doubled, the CPU
tier on, slru, and fp8 K/V (`kv_cache_dtype` fp8_e4m3: the live engine gets the pool
the what-if predicted, the same memory in one-byte values). A real model's steps are its
own, so the what-if's step cost is the engine's fit to them.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from engine.sim.capacity import format_table
from tests.support.stack import Stack

SIM = dict(simulate=1, vocab_size=32000, block_size=16, num_gpu_blocks=256,
           num_cpu_blocks=256, max_num_seqs=32, max_num_batched_tokens=512,
           simulate_step_ms=10, simulate_token_us=200)
SYSTEMS = [f"System {i}: you are a terse assistant for team {i}; answer in one line. " * 4
           for i in range(3)]
# lever: (the what-if's alternative, the live engine's settings beside SIM's)
LEVERS = {
    "GPU blocks halved": ({"num_gpu_blocks": 128}, {"num_gpu_blocks": 128}),
    "GPU blocks doubled": ({"num_gpu_blocks": 512}, {"num_gpu_blocks": 512}),
    "CPU tier on": ({"cpu_prefix_cache": True}, {"cpu_prefix_cache": 1}),
    "disk tier on": ({"disk_cache_bytes": 1 << 30}, {"disk_cache_bytes": 1 << 30,
                                                      "disk_cache_dir": "{disk}"}),
    "eviction slru": ({"eviction_policy": "slru"}, {"eviction_policy": "slru"}),
    "eviction lfu": ({"eviction_policy": "lfu"}, {"eviction_policy": "lfu"}),
    "eviction priority": ({"eviction_policy": "priority"}, {"eviction_policy": "priority"}),
    "max_num_seqs halved": ({"max_num_seqs": 16}, {"max_num_seqs": 16}),
    "pin budget 0": ({"pin_budget": 0.0}, {"pin_budget": 0.0}),
}


# The default model's engine, and its levers (the live pool sizes: the what-if's own
# alternative's, read from its answer, where a value is None)
MODEL = dict(num_gpu_blocks=256, num_cpu_blocks=256, max_num_seqs=32,
             max_num_batched_tokens=512)
MODEL_LEVERS = {
    "GPU blocks halved": ({"num_gpu_blocks": 128}, {"num_gpu_blocks": 128}),
    "GPU blocks doubled": ({"num_gpu_blocks": 512}, {"num_gpu_blocks": 512}),
    "CPU tier on": ({"cpu_prefix_cache": True}, {"cpu_prefix_cache": 1}),
    "eviction slru": ({"eviction_policy": "slru"}, {"eviction_policy": "slru"}),
    "fp8 K/V": ({"kv_cache_dtype": "fp8_e4m3"},
                {"kv_cache_dtype": "fp8_e4m3", "num_gpu_blocks": None, "num_cpu_blocks": None}),
}


def model_engine(device: str, dtype: str) -> dict:
    """The default model, named by its folder (a stack has a data folder of its own)."""
    from engine.model.model_runner import resolve_model_path
    return dict(model=str(resolve_model_path(None)), device=device, dtype=dtype, **MODEL)


def workload(n: int, seconds: float, seed: int = 0) -> list[tuple[float, str, int]]:
    """(arrival offset s, prompt, output tokens): chats of growing turns under shared
    system prompts, Poisson arrivals over `seconds`."""
    rng = random.Random(seed)
    chats: list[list[str]] = []
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(n / seconds)
        if not chats or rng.random() < 0.3 or all(len(c) > 8 for c in chats):
            chats.append([SYSTEMS[rng.randrange(len(SYSTEMS))]])
        chat = rng.choice([c for c in chats if len(c) <= 8])
        chat.append(f"Turn {len(chat)}: " + " ".join(rng.choice(["why", "how", "explain", "more",
                                                                 "blocks", "cache", "paged"])
                                                      for _ in range(rng.randint(8, 40))))
        out.append((t, " ".join(chat), rng.randint(16, 96)))
    return out


def _ts(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def run_trace(stack: Stack, engine: str, trace: list[tuple[float, str, int]]) -> dict:
    """Submit the trace to `engine` at its arrival times; once every job ended, what the
    engine did for them: hit rate, TTFT p50, preemptions."""
    ids: list[int] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def submit(prompt: str, tokens: int) -> None:
        r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": tokens,
                                                  "ignore_eos": True, "engine": engine})
        r.raise_for_status()
        with lock:
            ids.append(r.json()["id"])

    threads = []
    for at, prompt, tokens in trace:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        thread = threading.Thread(target=submit, args=(prompt, tokens))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    jobs = [stack.wait_job(i, timeout_s=600) for i in ids]
    prompt = sum(j["num_prompt_tokens"] for j in jobs)
    ttfts = [_ts(j["first_token_at"]) - _ts(j["queued_at"]) for j in jobs if j["first_token_at"]]
    return {"jobs": len(jobs), "finished": sum(j["status"] == "finished" for j in jobs),
            "prefix_hit_rate": sum(j["num_cached_tokens"] for j in jobs) / max(prompt, 1),
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "preemptions": sum(j["num_preemptions"] for j in jobs)}


def what_if(stack: Stack, engine: str, minutes: int, alternative: dict) -> dict:
    r = stack.api("POST", f"/api/engines/{engine}/what-if/",
                  json={"minutes": minutes, "max_jobs": 5000, **alternative})
    if r.status_code != 202:
        raise RuntimeError(f"what-if refused ({r.status_code}): {r.text[:300]}")
    run = {}

    def ended() -> bool:
        run.update(stack.api("GET", f"/api/engines/{engine}/what-if/{r.json()['id']}/").json())
        return run["status"] in ("finished", "failed")

    stack.wait(ended, "the what-if run", 600)
    if run["status"] != "finished":
        raise RuntimeError(f"what-if failed: {run['error']}")
    return run


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.what_if_fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--seconds", type=float, default=90.0, help="arrivals over this long")
    p.add_argument("--levers", default=None,
                   help="comma-separated, of: " + ", ".join(LEVERS) + "; with --model: "
                        + ", ".join(MODEL_LEVERS))
    p.add_argument("--model", choices=("default",), default=None,
                   help="the default model instead of the paced simulator")
    p.add_argument("--device", default="auto", help="with --model: its device")
    p.add_argument("--dtype", default="float32", help="with --model: its dtype")
    args = p.parse_args(argv)
    engine = model_engine(args.device, args.dtype) if args.model else SIM
    levers = MODEL_LEVERS if args.model else LEVERS
    chosen = [name.strip() for name in (args.levers or ",".join(levers)).split(",")]
    trace = workload(args.requests, args.seconds)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvops-fidelity-") as tmp:
        stack = Stack(Path(tmp))
        try:
            stack.start_web()
            stack.start_ops_worker()
            stack.start_engine("recorded", **engine)
            started = time.monotonic()
            recorded = run_trace(stack, "recorded", trace)

            def minutes() -> int:  # the window back from now that holds the recorded jobs
                return int((time.monotonic() - started) // 60) + 2

            base_run = what_if(stack, "recorded", minutes(), {})
            base = base_run["baseline"]
            f = base.get("fidelity") or {}
            rows.append(["baseline (its own configuration)", _pct(base["prefix_hit_rate"]),
                         _pct(recorded["prefix_hit_rate"]), _ms(base["ttft_p50"]),
                         _ms(recorded["ttft_p50"]), str(base["preemptions"]),
                         str(recorded["preemptions"]), ", ".join(f.get("misses") or []) or "-"])
            step = base_run["trace"].get("step_cost") or {}
            for i, lever in enumerate(chosen):
                alternative, settings = levers[lever]
                try:
                    predicted = what_if(stack, "recorded", minutes(), alternative)["alternative"]
                except RuntimeError as e:
                    rows.append([lever, str(e)[:60], "", "", "", "", "", ""])
                    print(lever, e, flush=True)
                    continue
                live_settings = {k: (str(Path(tmp) / f"disk-{i}") if v == "{disk}" else
                                     predicted["config"][k] if v is None else v)
                                 for k, v in settings.items()}
                name = f"live-{i}"
                stack.start_engine(name, **{**engine, **live_settings})
                measured = run_trace(stack, name, trace)
                stack.kill(f"engine-{name}")
                rows.append([lever, _pct(predicted["prefix_hit_rate"]),
                             _pct(measured["prefix_hit_rate"]), _ms(predicted["ttft_p50"]),
                             _ms(measured["ttft_p50"]), str(predicted["preemptions"]),
                             str(measured["preemptions"]), ""])
                print(" | ".join(rows[-1]), flush=True)
        finally:
            stack.stop()
    engines = (f"the default model ({args.device}, {args.dtype})" if args.model else
               f"simulated engines at {SIM['simulate_step_ms']} ms a step + "
               f"{SIM['simulate_token_us']} us a token")
    print(f"\n{args.requests} requests (multi-turn chats under {len(SYSTEMS)} system prompts) "
          f"over {args.seconds:.0f} s; {engines}, {engine['num_gpu_blocks']} GPU blocks; the "
          f"what-if's step cost: {step}")
    print(format_table(["lever", "hit rate predicted", "measured", "TTFT p50 predicted",
                        "measured", "preemptions predicted", "measured", "baseline misses"],
                       rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
