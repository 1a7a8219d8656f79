"""One decode step, measured by phase: where a step's time goes at 1, 32 and 256 running.

    python -m benchmarks.bench_step [--device cpu|cuda] [--model stand-in|default|PATH]
                                    [--running 1,32,256] [--steps 30] [--dtype float32|bfloat16]
                                    [--enforce-eager] [--async-scheduling auto|on|off]

A step of the engine core (LLMEngine.step_core, what the core process runs) split into:
scheduling (the scheduler's schedule), input preparation (the step's tensors from the
scheduler's output, engine/model/input_batch.py), the forward pass (the host's time to
issue it; on CUDA also the device's time, by CUDA events), sampling (the sampler and the
sampled ids to the host) and the rest of the step (the scheduler's update and the outputs),
a decode step replayed as a CUDA graph counting as the forward pass (`--enforce-eager`:
op by op); with async scheduling (on with CUDA) a step's outputs are the step before's,
read back while its own forward pass runs,
plus the launches a step makes: CUDA kernels on a GPU, torch operators on a CPU (one
profiled step each, apart from the timed ones).

The stand-in model has the default model's depth and head layout (30 layers, 9 query
heads, 3 KV heads) at a tiny width and vocabulary, so on a CPU the figures are the host's
cost of a step, not the matmuls'; `--model default` runs SmolLM2-135M itself (on CUDA:
the figures issue 47's targets are stated in). Every request decodes (prompts of 16
tokens, prefilled before timing starts, ignore_eos), so each timed step is a pure decode
step of `running` sequences.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.default_model import default_model_dir

PHASES = ("schedule", "prepare", "forward", "sample", "rest")
PROMPT_TOKENS = 16


def stand_in_model(root: Path) -> Path:
    """A random Llama with the default model's 30 layers and 9/3 heads of 64, at width
    9 x 8 = 72 (head size 8), an MLP of 96 and a vocabulary of 1,024; the default model's
    tokenizer files beside it (only token ids below 1,024 are used)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / "stand-in"
    config = LlamaConfig(vocab_size=1024, hidden_size=72, intermediate_size=96,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=8, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


class PhaseClock:
    """Wraps the engine's parts at their boundaries and sums each phase's time per step."""

    def __init__(self, engine: LLMEngine, cuda: bool) -> None:
        self.cuda = cuda
        self.totals: dict[str, list[float]] = defaultdict(list)
        self.device_ms: list[float] = []
        self._step: dict[str, float] = {}
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner.input_batch, "prepare", "prepare")
        self._wrap(runner, "_run_model", "forward", device=True)
        graphs = getattr(runner, "decode_graphs", None)
        if graphs is not None and graphs.capture:  # a replay, instead of _run_model
            self._wrap(graphs, "run", "forward", device=True)
        self._wrap(runner, "sample", "sample")
        self._wrap(runner, "collect", "sample")

    def _wrap(self, owner: object, name: str, phase: str, device: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if device and self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._step[phase] = self._step.get(phase, 0.0) + time.perf_counter() - t0
                if device and self.cuda:
                    end.record()
                    self._events = (start, end)

        setattr(owner, name, timed)

    def step(self, engine: LLMEngine) -> None:
        self._step, self._events = {}, None
        t0 = time.perf_counter()
        engine.step_core()
        total = time.perf_counter() - t0
        s = self._step
        for phase in PHASES[:4]:
            self.totals[phase].append(s.get(phase, 0.0))
        self.totals["rest"].append(total - sum(self.totals[p][-1] for p in PHASES[:4]))
        self.totals["step"].append(total)
        if self._events is not None:
            torch.cuda.synchronize()
            self.device_ms.append(self._events[0].elapsed_time(self._events[1]))


def launches_per_step(engine: LLMEngine, cuda: bool) -> int:
    """Kernels launched by one step on a GPU; torch operators dispatched on a CPU (the
    host-side count that launches become on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        engine.step_core()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)


def run(model: str, device: str, dtype: str, running: int, steps: int,
        enforce_eager: bool = False, async_scheduling: bool | None = None) -> dict:
    blocks_per_seq = (PROMPT_TOKENS + steps + 16) // 16 + 2
    engine = LLMEngine(EngineConfig(
        model=model, device=device, dtype=dtype, block_size=16, max_num_seqs=max(running, 1),
        max_num_batched_tokens=max(2048, running * PROMPT_TOKENS),
        num_gpu_blocks=running * blocks_per_seq + 16, num_cpu_blocks=0,
        enable_prefix_caching=False, seed=0, enforce_eager=enforce_eager,
        async_scheduling=async_scheduling))
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(running):
        prompt = [(7 + 31 * i + 3 * j) % (vocab - 10) + 5 for j in range(PROMPT_TOKENS)]
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step_core()  # prefill (and the first decodes) untimed
    cuda = device == "cuda"
    launches = launches_per_step(engine, cuda)
    clock = PhaseClock(engine, cuda)
    for _ in range(3):  # warm-up
        clock.step(engine)
    clock.totals.clear()
    clock.device_ms.clear()
    for _ in range(steps):
        clock.step(engine)
    median_ms = {k: statistics.median(v) * 1e3 for k, v in clock.totals.items()}
    median_ms["device"] = statistics.median(clock.device_ms) if clock.device_ms else None
    median_ms["launches"] = launches
    median_ms["tok_s"] = running / (median_ms["step"] / 1e3)
    reason = engine.runner.eager_reason
    median_ms["decode"] = (f"eager ({reason})" if reason else (
        "CUDA graphs" if engine.runner.decode_graphs.capture else "padded, eager")) + (
        ", async scheduling" if engine.async_scheduling else ", a step at a time")
    engine.close()
    return median_ms


def print_table(rows: list[tuple[int, dict]], model: str, device: str, dtype: str) -> None:
    print(f"\nbench_step: {model} on {device} ({dtype}), decode steps "
          f"{rows[0][1]['decode']}; medians of the timed decode steps, ms")
    head = (f"{'running':>7} {'step':>7} {'sched':>7} {'prepare':>7} {'forward':>7} "
            f"{'(device)':>8} {'sample':>7} {'rest':>7} {'launches':>8} {'tok/s':>9}")
    print(head)
    print("-" * len(head))
    for n, m in rows:
        device_ms = f"{m['device']:8.2f}" if m["device"] is not None else f"{'-':>8}"
        print(f"{n:>7} {m['step']:7.2f} {m['schedule']:7.2f} {m['prepare']:7.2f} "
              f"{m['forward']:7.2f} {device_ms} {m['sample']:7.2f} {m['rest']:7.2f} "
              f"{m['launches']:>8} {m['tok_s']:9.0f}")
    print("forward: the host's time to issue the forward pass (on a GPU it returns before the "
          "device is done; (device) is the device's time); sample: the sampler and the ids to the "
          "host; rest: the scheduler's update and the outputs; launches: CUDA kernels (GPU) or "
          "torch operators (CPU) in one step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="stand-in",
                   help="stand-in (default), default (SmolLM2-135M) or an HF folder")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--running", default="1,32,256", help="running sequences, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps at each size")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode steps op by op, not as CUDA graphs (EngineConfig.enforce_eager)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="issue each step before the one before is read back "
                        "(EngineConfig.async_scheduling; auto: on with CUDA)")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory(prefix="kvops-bench-step-") as tmp:
        if args.model == "stand-in":
            model = str(stand_in_model(Path(tmp)))
        elif args.model == "default":
            model = str(default_model_dir())
        else:
            model = args.model
        ahead = {"auto": None, "on": True, "off": False}[args.async_scheduling]
        rows = [(n, run(model, args.device, dtype, n, args.steps, args.enforce_eager, ahead))
                for n in (int(x) for x in args.running.split(","))]
    print_table(rows, args.model, args.device, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
