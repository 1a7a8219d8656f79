"""Throughput benchmark: one workload through kvops and through transformers
`generate` (static batches, left padding) in the same process, on the same weights.

    python -m benchmarks.bench_engine [--model PATH] [--num-requests 32] [--hf-batch-sizes 8,32]
                           [--torch-paths] [--dtype float32|bfloat16] [--repeats N]

Workload: prompts of uniform random length in [16, 256] (random token ids), outputs of
uniform random length in [16, 128], greedy, ignore_eos; then the same prompts behind a
shared 200-token system prompt. "Useful" tokens and FLOPs are the ones the requests
asked for: padding, tokens generated past a request's own length, and prefill skipped
by the prefix cache do not count. The FLOP rate is compared with the machine's matmul
rate, measured on the spot in the same dtype: a 4096^3 matmul by torch.mm (MKL) and, in
float32 with the CPU kernels built, by kvops' packed kernel, whichever is faster (on
AMD CPUs MKL reaches about half of what the FMA units can do, and a fraction of that
would flatter). --dtype bfloat16 runs both systems in bfloat16.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.transformer import ModelArgs


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix_len: int = 0

    @property
    def useful_tokens(self) -> int:
        return sum(len(p) for p in self.prompts) + sum(self.output_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class Result:
    system: str
    seconds: float
    flops: float  # useful FLOPs this system had to compute
    note: str = ""


def make_workloads(num_requests: int, vocab_size: int, seed: int,
                   system_prompt_len: int = 200) -> list[Workload]:
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)  # skip the special tokens at the start of the vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    prompts = [tokens(rng.randint(16, 256)) for _ in range(num_requests)]
    output_lens = [rng.randint(16, 128) for _ in range(num_requests)]
    system = tokens(system_prompt_len)
    return [Workload("plain", prompts, output_lens),
            Workload(f"{system_prompt_len}-token shared system prompt",
                     [system + p for p in prompts], output_lens, system_prompt_len)]


def useful_flops(args: ModelArgs, w: Workload, cached: list[int] | None = None) -> float:
    """Matmul FLOPs of the tokens the requests need: 2 x weights per token fed, the
    attention of each token over its context, and the LM head for each sampled token.
    cached[i]: prompt tokens of request i served from the prefix cache (not computed)."""
    d, hd = args.dim, args.head_dim
    per_layer = d * (args.n_heads + 2 * args.n_kv_heads) * hd + args.n_heads * hd * d \
        + 3 * d * args.intermediate_size
    total = 0.0
    for i, (prompt, out_len) in enumerate(zip(w.prompts, w.output_lens)):
        skip = cached[i] if cached else 0
        fed = len(prompt) + out_len - 1  # the last sampled token is never fed back
        # the token at position p attends to p + 1 keys
        attended = fed * (fed + 1) / 2 - skip * (skip + 1) / 2
        total += 2 * per_layer * args.n_layers * (fed - skip)
        total += 4 * args.n_heads * hd * args.n_layers * attended
        total += 2 * d * args.vocab_size * out_len
    return total


def matmul_rates(n: int = 4096, repeats: int = 5, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> dict[str, float]:
    """FLOP/s of an n x n x n matmul (best of a few) by torch.mm, and by the packed
    kernel of kernels/csrc/small_gemm.cpp where it runs (float32, built here)."""
    from kernels import cpu_ext

    if device != "cpu":
        x, w = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype,
                                                                            device=device)
        best = float("inf")
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            torch.mm(x, w)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return {"torch.mm": 2 * n ** 3 / best}
    return cpu_ext.time_matmuls(n, n, n, repeats, dtype,
                                packed=dtype == torch.float32 and cpu_ext.available())


def run_kvops(engine: LLMEngine, w: Workload, system: str = "kvops") -> Result:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in w.output_lens]
    before = engine.metrics()
    t = time.perf_counter()
    outs = engine.generate(w.prompts, params)
    seconds = time.perf_counter() - t
    after = engine.metrics()
    assert [len(o.output_token_ids) for o in outs] == w.output_lens
    note = f"{after['num_steps'] - before['num_steps']} steps"
    cached = [o.num_cached_tokens for o in outs]
    if w.shared_prefix_len:
        bs = engine.config.block_size
        full = w.shared_prefix_len // bs * bs
        ideal = full * (len(w.prompts) - 1)
        note += (f"; prefill skipped by the prefix cache: {sum(cached)} tokens (shared full "
                 f"blocks: {full} tokens x {len(w.prompts) - 1} requests = {ideal})")
    flops = useful_flops(engine.runner.folder.args, w, cached)
    return Result(system, seconds, flops, note)


def run_constrained(engine: LLMEngine, w: Workload, repeats: int = 2) -> tuple[float, float]:
    """Seconds for the workload unconstrained and under a JSON schema (an object whose one
    string field is longer than any output here, so that, with EOS biased away, every
    request produces its length either way): the difference is the cost of the grammar
    masks (filled per request, applied to the batch each step). The grammar is compiled
    in a warm-up first (once per engine and constraint, as in a running service); the
    runs alternate and the best of each counts."""
    eos = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    regex = {"json": {"type": "object", "additionalProperties": False, "required": ["text"],
                      "properties": {"text": {"type": "string", "minLength": 4000}}}}
    engine.generate(w.prompts[:2], SamplingParams(max_tokens=2, structured=regex))
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for k, structured in enumerate((None, regex)):
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                     logit_bias=eos, structured=structured)
                      for n in w.output_lens]
            engine.reset_prefix_cache()
            t = time.perf_counter()
            outs = engine.generate(w.prompts, params)
            best[k] = min(best[k], time.perf_counter() - t)
            assert [len(o.output_token_ids) for o in outs] == w.output_lens
    return best[0], best[1]


def run_parallel(engine: LLMEngine, w: Workload, n: int) -> dict:
    """The workload with n samples per prompt (sampled, seeded), against n separate
    requests per prompt: seconds, output tokens, and prompt tokens computed by each (a
    fork computes its prompt once; separate requests share only full blocks through the
    prefix cache, so each computes its last partial block)."""
    out = {}
    for label in ("fork", "separate"):
        engine.reset_prefix_cache()
        before = engine.metrics()["num_prompt_tokens"]
        if label == "fork":
            prompts = w.prompts
            params = [SamplingParams(max_tokens=k, temperature=1.0, seed=7, ignore_eos=True,
                                     n=n) for k in w.output_lens]
        else:
            prompts = [p for p in w.prompts for _ in range(n)]
            params = [SamplingParams(max_tokens=k, temperature=1.0, seed=7 + i, ignore_eos=True)
                      for k in w.output_lens for i in range(n)]
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t
        produced = sum(len(s.output_token_ids) for o in outs for s in (o.samples or [o]))
        assert produced == n * w.output_tokens
        out[label] = {"seconds": seconds, "tokens": produced,
                      "prompt_tokens": engine.metrics()["num_prompt_tokens"] - before}
    return out


def run_hf(model, w: Workload, batch_size: int) -> float:
    """Static batches in arrival order, left-padded; each batch runs to its longest output."""
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(w.prompts), batch_size):
            prompts, lens = w.prompts[i:i + batch_size], w.output_lens[i:i + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts],
                               device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                device=model.device)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                           do_sample=False, pad_token_id=0)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the kvops requests
    return model


def print_table(w: Workload, results: list[Result], peak: float) -> None:
    print(f"\nworkload: {w.name}: {len(w.prompts)} requests, "
          f"{sum(len(p) for p in w.prompts)} prompt + {w.output_tokens} output tokens")
    header = (f"{'system':<26}{'seconds':>9}{'out tok/s':>11}{'all tok/s':>11}"
              f"{'GFLOP/s':>9}{'% mm':>7}  notes")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.system:<26}{r.seconds:>9.2f}{w.output_tokens / r.seconds:>11.1f}"
              f"{w.useful_tokens / r.seconds:>11.1f}{r.flops / r.seconds / 1e9:>9.1f}"
              f"{100 * r.flops / r.seconds / peak:>6.0f}%  {r.note}")
    hf = [r for r in results if r.system.startswith("transformers")]
    if hf and results[0].system == "kvops":
        best = min(hf, key=lambda r: r.seconds)
        print(f"kvops / best transformers ({best.system}): "
              f"{best.seconds / results[0].seconds:.2f}x useful tokens/s")


def _engine_without_cpu_kernels(config: EngineConfig) -> LLMEngine:
    return LLMEngine(dataclasses.replace(config, cpu_kernels=False))


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvops vs transformers throughput")
    p.add_argument("--model", default=None, help="HF folder (default: the converted default model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-prompt-len", type=int, default=200)
    p.add_argument("--hf-batch-sizes", default="8,32",
                   help="static batch sizes for transformers, comma-separated ('' skips it)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--torch-paths", action="store_true",
                   help="also run kvops with its C++ CPU kernels off (cpu_kernels=False)")
    p.add_argument("--device", default="cpu",
                   help="the engine's and transformers' device (cpu, cuda)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both systems' dtype (and the matmul rate's)")
    p.add_argument("--matmul-size", type=int, default=4096,
                   help="n of the n^3 matmul that measures the machine's peak rate "
                        "(a CPU without bfloat16 units takes minutes at 4096)")
    p.add_argument("--repeats", type=int, default=1, help="runs per system; the best is shown")
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="also run the first workload with N samples per prompt (a fork) "
                        "against N separate requests per prompt")
    p.add_argument("--structured", action="store_true",
                   help="also time the first workload under a grammar against unconstrained")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(config)
    torch_engine = _engine_without_cpu_kernels(config) if args.torch_paths else None
    model_args = engine.runner.folder.args
    workloads = make_workloads(args.num_requests, model_args.vocab_size, args.seed,
                               args.system_prompt_len)
    rates = matmul_rates(args.matmul_size, dtype=dtype, device=args.device)
    peak = max(rates.values())
    print(f"model {engine.runner.model_id}, {torch.get_num_threads()} threads; "
          f"{args.dtype} matmul {args.matmul_size}^3: "
          + ", ".join(f"{name} {rate / 1e9:.0f}" for name, rate in rates.items())
          + f" GFLOP/s (% mm below: of the best, {peak / 1e9:.0f}); C++ CPU kernels "
          f"{'on' if engine.runner.cpu_kernels else 'off'}")
    hf_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    hf_model = load_hf(str(engine.runner.folder.path), dtype, args.device) if hf_sizes else None
    warm_prompts = workloads[0].prompts[:4]
    warm = Workload("warm-up", warm_prompts, [4] * len(warm_prompts))
    run_kvops(engine, warm)
    if torch_engine is not None:
        run_kvops(torch_engine, warm)
    if hf_model is not None:
        run_hf(hf_model, warm, 4)
    for w in workloads:
        print(f"\nload average before {w.name!r}: {_loadavg()} (other processes slow every "
              "number down; --repeats keeps each system's best run)")
        best: dict[str, Result] = {}
        for _ in range(args.repeats):  # interleaved, so a busy spell hits both systems
            engine.reset_prefix_cache()
            runs = [run_kvops(engine, w)]
            if torch_engine is not None:
                torch_engine.reset_prefix_cache()
                runs.append(run_kvops(torch_engine, w, "kvops (torch paths)"))
            runs += [Result(f"transformers (batch {b})", run_hf(hf_model, w, b),
                            useful_flops(model_args, w)) for b in hf_sizes]
            for r in runs:
                if r.system not in best or r.seconds < best[r.system].seconds:
                    best[r.system] = r
        print_table(w, list(best.values()), peak)
        print(f"load average after: {_loadavg()}")
    if args.parallel:
        w = workloads[0]
        result = run_parallel(engine, w, args.parallel)
        prompt_tokens = sum(len(p) for p in w.prompts)
        print(f"\nn={args.parallel} samples per prompt on {w.name!r} ({prompt_tokens} prompt "
              "tokens):")
        for label, r in result.items():
            print(f"  {label:<9} {r['tokens'] / r['seconds']:7.1f} output tok/s, "
                  f"{r['prompt_tokens']} prompt tokens computed")
    if args.structured:
        w = workloads[0]
        plain_s, constrained_s = run_constrained(engine, w)
        print(f"\nstructured output on {w.name!r}: unconstrained {w.output_tokens / plain_s:.0f} "
              f"output tok/s, under a JSON schema {w.output_tokens / constrained_s:.0f} "
              f"(overhead {100 * (constrained_s / plain_s - 1):.1f}%; target <= 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
