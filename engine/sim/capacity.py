"""Replay a trace through the real scheduler and KV manager (simulated model), and
through a contiguous max-length reservation allocator for comparison."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.observe.step_cost import DEFAULT_COST, StepCost, StepShape
from engine.sampling_params import SamplingParams
from engine.sim.trace import TraceRequest, prompt_tokens


@dataclass(slots=True)
class ReplayResult:
    name: str
    num_requests: int
    sim_seconds: float  # simulated time until the last request finished
    steps: int
    utilisation: float  # token slots holding K/V / slots allocated, averaged over steps
    peak_concurrency: int  # most requests holding memory at once
    mean_concurrency: float
    preemptions: int = 0
    swaps_out: int = 0
    prefix_hit_rate: float = 0.0  # prompt tokens served from the cache / prompt tokens looked up
    wall_seconds: float = 0.0  # real time the replay took
    extra: dict = field(default_factory=dict)

    def row(self) -> list[str]:
        return [self.name, str(self.num_requests), f"{self.sim_seconds:.1f}", str(self.steps),
                f"{100 * self.utilisation:.1f}%", str(self.peak_concurrency),
                f"{self.mean_concurrency:.1f}", str(self.preemptions), str(self.swaps_out),
                f"{100 * self.prefix_hit_rate:.1f}%"]


HEADER = ["allocator", "requests", "sim s", "steps", "KV util", "peak conc", "mean conc",
          "preempt", "swaps", "prefix hit"]


def slot_usage(engine: LLMEngine) -> tuple[int, int]:
    """(token slots holding K/V, slots in blocks held by requests); a shared block once."""
    bs, kv = engine.config.block_size, engine.kv
    fill: dict[int, int] = {}
    for manager in kv.groups:  # (a hybrid model's every layer group)
        for rid, table in manager.req_to_blocks.items():
            computed = engine.scheduler.requests[rid].num_computed_tokens
            for i, block in enumerate(table, start=manager.window_freed(rid)):
                fill[block.block_id] = max(fill.get(block.block_id, 0),
                                           min(bs, max(computed - i * bs, 0)))
    return sum(fill.values()), len(fill) * bs


class ReplayObserver(Protocol):
    """Told about each step of a paged replay (engine/sim/replay_stats.py records one)."""

    def before_step(self, engine: LLMEngine, now: float) -> None: ...

    def after_step(self, engine: LLMEngine, now: float) -> None: ...


def replay_paged(trace: list[TraceRequest], config: EngineConfig,
                 cost: StepCost = DEFAULT_COST, name: str = "paged",
                 prompts: list[list[int]] | None = None,
                 observer: ReplayObserver | None = None,
                 pins: list[list[int]] | None = None) -> ReplayResult:
    """prompts: each trace request's token ids (None: made up by trace.prompt_tokens
    from its prefix group); observer: read before and after every step, at simulated
    time `now` (the step's start, then its end); pins: prefixes computed and pinned
    before the trace (as an operator pinned them), within the configuration's pin
    budget (those past it are refused, counted); their steps are not the replay's."""
    engine = LLMEngine(config)
    pinned, refused = _pin(engine, pins or [])
    before = engine.metrics()  # (the pins' prefills are not the trace's)
    vocab = config.vocab_size
    pending = list(enumerate(trace))
    now, used_sum, alloc_sum, conc_sum, peak, steps = 0.0, 0, 0, 0, 0, 0
    wall = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_s <= now:
            i, req = pending.pop(0)
            tokens = prompts[i] if prompts is not None else prompt_tokens(req, i, vocab)
            engine.add_request(f"t{i}", tokens,
                               SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                               arrival_time=req.arrival_s)
        if not engine.has_unfinished_requests():
            now = pending[0][1].arrival_s
            continue
        tokens_before = engine.scheduler.counters.num_prompt_tokens \
            + engine.scheduler.counters.num_generation_tokens
        if observer is not None:
            observer.before_step(engine, now)
        engine.step()
        steps += 1
        batched = engine.scheduler.counters.num_prompt_tokens \
            + engine.scheduler.counters.num_generation_tokens - tokens_before
        now += cost.seconds(engine.last_step_shape or StepShape(prefill_tokens=batched))
        if observer is not None:
            observer.after_step(engine, now)
        used, allocated = slot_usage(engine)
        used_sum += used
        alloc_sum += allocated
        holding = len(engine.kv.req_to_blocks)
        conc_sum += holding
        peak = max(peak, holding)
    m = engine.metrics()
    for key in _COUNTED:
        m[key] = m.get(key, 0) - before.get(key, 0)
    engine.close()  # (a disk tier's writes finish)
    queries = max(m["prefix_cache_queries"], 1)
    return ReplayResult(
        name=name, num_requests=len(trace), sim_seconds=now, steps=steps,
        utilisation=used_sum / alloc_sum if alloc_sum else 0.0, peak_concurrency=peak,
        mean_concurrency=conc_sum / max(steps, 1), preemptions=m["num_preemptions"],
        swaps_out=m["num_swaps_out"],
        prefix_hit_rate=m["prefix_cache_hits"] / queries,
        wall_seconds=time.perf_counter() - wall,
        extra={"cpu_hit_rate": m["cpu_prefix_cache_hits"] / queries,
               "disk_hit_rate": m.get("disk_prefix_cache_hits", 0) / queries,
               "prompt_tokens_computed": m["num_prompt_tokens"],
               "pinned_blocks": pinned, "pins_refused": refused})


# the counters a replay reports, less what the pins' prefills added
_COUNTED = ("prefix_cache_queries", "prefix_cache_hits", "cpu_prefix_cache_hits",
            "disk_prefix_cache_hits", "num_prompt_tokens", "num_preemptions", "num_swaps_out")


def _pin(engine: LLMEngine, pins: list[list[int]]) -> tuple[int, int]:
    """Compute each prefix and pin it (hard, as an operator does); (blocks pinned,
    prefixes refused: past the pin budget, or too short to hold a block)."""
    pinned = refused = 0
    for k, tokens in enumerate(pins):
        engine.add_request(f"pin{k}", tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        try:
            pinned += engine.pin_prefix(tokens)["num_newly_pinned"]
        except EngineError:
            refused += 1
    return pinned, refused


def replay_contiguous(trace: list[TraceRequest], total_slots: int, max_model_len: int,
                      max_num_seqs: int, max_num_batched_tokens: int,
                      cost: StepCost = DEFAULT_COST, window: int | None = None) -> ReplayResult:
    """Each admitted request reserves max_model_len contiguous slots until it ends, as a
    server without paging must (it cannot know the output length in advance). With a
    sliding window on every layer, a ring buffer of the window's length instead."""
    reserve = min(max_model_len, window) if window else max_model_len
    pending = list(trace)
    waiting: list[list[int]] = []  # [prompt_left, output_left, stored]
    running: list[list[int]] = []
    now, steps, used_sum, alloc_sum, conc_sum, peak = 0.0, 0, 0, 0, 0, 0
    capacity = total_slots // reserve
    if capacity == 0:
        raise ValueError("the pool cannot hold one max-length request")
    while pending or waiting or running:
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            waiting.append([r.prompt_len, min(r.output_len, max_model_len - r.prompt_len), 0])
        while waiting and len(running) < min(capacity, max_num_seqs):
            running.append(waiting.pop(0))
        if not running:
            now = pending[0].arrival_s
            continue
        budget = max_num_batched_tokens
        batched = 0
        for r in running:
            n = min(r[0], budget) if r[0] else (1 if budget else 0)
            if r[0]:
                r[0] -= n
                r[2] += n
                if r[0] == 0:
                    r[1] -= 1  # the prefill's last token samples the first output
            elif n:
                r[1] -= 1
                r[2] += 1
            budget -= n
            batched += n
        running = [r for r in running if r[1] > 0]
        steps += 1
        now += cost.seconds(StepShape(prefill_tokens=batched))  # (a token's cost each)
        used_sum += sum(min(r[2], reserve) for r in running)
        alloc_sum += len(running) * reserve
        conc_sum += len(running)
        peak = max(peak, len(running))
    return ReplayResult(
        name="contiguous", num_requests=len(trace), sim_seconds=now, steps=steps,
        utilisation=used_sum / alloc_sum if alloc_sum else 0.0, peak_concurrency=peak,
        mean_concurrency=conc_sum / max(steps, 1))


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
