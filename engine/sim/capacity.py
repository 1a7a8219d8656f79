"""Replay a trace through the real scheduler and KV manager (simulated model), and
through a contiguous max-length reservation allocator for comparison."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.observe.step_cost import DEFAULT_COST, StepCost, StepShape
from engine.sampling_params import SamplingParams
from engine.sim import replay_actions
from engine.sim.replay_actions import ReplayAction
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
    """(token slots holding K/V, slots in blocks held by requests); a shared block once,
    as full as its fullest holder has it. (Every step of a replay: the loop touches each
    held block once, with no arithmetic per block.)"""
    bs, requests = engine.config.block_size, engine.scheduler.requests
    held: set[int] = set()  # blocks in a request's table
    full: set[int] = set()  # of which a holder has filled
    partial: dict[int, int] = {}  # a holder's last block, partly filled: its tokens
    for manager in engine.kv.groups:  # (a hybrid model's every layer group)
        for rid, table in manager.req_to_blocks.items():
            ids = [block.block_id for block in table]
            held.update(ids)
            # table place i holds the request's block window_freed + i: those before
            # its computed tokens' last block are full, that one holds the rest
            computed = requests[rid].num_computed_tokens
            last = computed // bs - manager.window_freed(rid)
            if last > 0:
                full.update(ids[:last])
            if 0 <= last < len(ids) and computed % bs:
                partial[ids[last]] = max(partial.get(ids[last], 0), computed % bs)
    used = len(full) * bs + sum(n for block, n in partial.items() if block not in full)
    return used, len(held) * bs


class ReplayObserver(Protocol):
    """Told about each step of a paged replay (engine/sim/replay_stats.py records one)."""

    def before_step(self, engine: LLMEngine, now: float) -> None: ...

    def after_step(self, engine: LLMEngine, now: float) -> None: ...


@dataclass(slots=True)
class WarmUp:
    """Traffic replayed before the trace to fill the cache as it was at the trace's
    start (the engine's jobs just before it), counted in no figure of the replay."""
    requests: list[TraceRequest]  # in arrival order, times after its own first arrival
    prompts: list[list[int]]  # each request's token ids
    actions: list[ReplayAction] = field(default_factory=list)  # on its requests, its times
    # seconds from its first arrival to the trace's first (its times, less this, are
    # the trace's: how a refused action's time is reported)
    lead_s: float = 0.0


def replay_paged(trace: list[TraceRequest], config: EngineConfig,
                 cost: StepCost = DEFAULT_COST, name: str = "paged",
                 prompts: list[list[int]] | None = None,
                 observer: ReplayObserver | None = None,
                 pins: list[list[int]] | None = None,
                 actions: list[ReplayAction] | None = None,
                 warmup: WarmUp | None = None) -> ReplayResult:
    """prompts: each trace request's token ids (None: made up by trace.prompt_tokens
    from its prefix group); observer: read before and after every step, at simulated
    time `now` (the step's start, then its end); pins: prefixes computed and pinned
    before the trace (as an operator pinned them), within the configuration's pin
    budget (those past it are refused, counted); their steps are not the replay's.
    actions: operator actions applied at their simulated times (replay_actions.py);
    those the engine refuses in the replay are listed in extra["actions_refused"].
    warmup: replayed after the pins and before the trace, to its end (requests it
    leaves that cannot run, a pause never resumed, are aborted there); none of its
    steps or counts are the replay's, its cached blocks are."""
    # (no text, stepped by step_core, and no KV history: the replay reads neither)
    engine = LLMEngine(dataclasses.replace(config, kv_history_blocks=0), detokenize=False)
    pinned, refused = _pin(engine, pins or [])
    refusals: list[dict] = []
    if warmup is not None:
        warm = _Run(engine, warmup.requests, warmup.prompts, warmup.actions, cost, "w",
                    report_offset_s=-warmup.lead_s, skip_refused=True)
        warm.run(every_action=True)
        for request_id in list(engine.scheduler.requests):  # (only the warm-up's)
            engine.abort(request_id)
        refusals += warm.refusals
    before = engine.metrics()  # (the pins' and the warm-up's prefills are not the trace's)
    wall = time.perf_counter()
    run = _Run(engine, trace, prompts, actions or [], cost, "t", observer)
    run.run()
    m = engine.metrics()
    for key in _COUNTED:
        m[key] = m.get(key, 0) - before.get(key, 0)
    engine.close()  # (a disk tier's writes finish)
    queries = max(m["prefix_cache_queries"], 1)
    steps = run.steps
    return ReplayResult(
        name=name, num_requests=len(trace), sim_seconds=run.now, steps=steps,
        utilisation=run.used_sum / run.alloc_sum if run.alloc_sum else 0.0,
        peak_concurrency=run.peak, mean_concurrency=run.conc_sum / max(steps, 1),
        preemptions=m["num_preemptions"], swaps_out=m["num_swaps_out"],
        prefix_hit_rate=m["prefix_cache_hits"] / queries,
        wall_seconds=time.perf_counter() - wall,
        extra={"cpu_hit_rate": m["cpu_prefix_cache_hits"] / queries,
               "disk_hit_rate": m.get("disk_prefix_cache_hits", 0) / queries,
               "prompt_tokens_computed": m["num_prompt_tokens"],
               "pinned_blocks": pinned, "pins_refused": refused,
               "actions_applied": run.applied, "actions_refused": refusals + run.refusals,
               "warmup_requests": len(warmup.requests) if warmup is not None else 0})


class _Run:
    """One pass of requests and operator actions through the engine, in simulated time:
    arrivals and actions in time order (an arrival first at the same time), a step
    whenever there is work and the engine is not paused, else a wait for the next
    arrival or action. `prefix` names its requests ("t3": the trace's fourth);
    report_offset_s is added to a refused action's time where it is reported;
    skip_refused: a request the configuration cannot take (longer than its pool) is left
    out, not an error (the warm-up's, which no check of the window covers)."""

    def __init__(self, engine: LLMEngine, trace: list[TraceRequest],
                 prompts: list[list[int]] | None, actions: list[ReplayAction],
                 cost: StepCost, prefix: str, observer: ReplayObserver | None = None,
                 report_offset_s: float = 0.0, skip_refused: bool = False) -> None:
        self.engine, self.cost, self.prefix, self.observer = engine, cost, prefix, observer
        self.report_offset_s, self.skip_refused = report_offset_s, skip_refused
        self.trace, self.prompts = trace, prompts
        self.pending = deque(enumerate(trace))
        self.actions = deque(sorted(actions, key=lambda a: a.at_s))  # (stable: log order)
        self.now, self.steps, self.peak = 0.0, 0, 0
        self.used_sum = self.alloc_sum = self.conc_sum = 0
        self.applied = 0
        self.refusals: list[dict] = []  # {action, at, why} the engine refused here

    def run(self, every_action: bool = False) -> None:
        """Until every request has ended (or none left can run); every_action: then the
        actions left too (those after the last request, which still change the cache)."""
        engine = self.engine
        while self.pending or engine.has_unfinished_requests():
            self._arrive_and_act()
            if not engine.paused and engine.has_work_to_run() and self._step():
                continue
            # nothing ran: wait for the next arrival or action (none left: the requests
            # left cannot run, a pause never resumed or a request parked, and end here)
            upcoming = self._next_event()
            if upcoming is None:
                break
            self.now = max(self.now, upcoming)
        while every_action and self.actions:
            self._act(self.actions.popleft())

    def _next_event(self) -> float | None:
        times = [self.pending[0][1].arrival_s] if self.pending else []
        if self.actions:
            times.append(self.actions[0].at_s)
        return min(times, default=None)

    def _arrive_and_act(self) -> None:
        vocab = self.engine.config.vocab_size
        while True:
            arrival = self.pending[0][1].arrival_s if self.pending else None
            act = self.actions[0].at_s if self.actions else None
            if arrival is not None and arrival <= self.now and (act is None or arrival <= act):
                i, req = self.pending.popleft()
                tokens = self.prompts[i] if self.prompts is not None \
                    else prompt_tokens(req, i, vocab)
                try:
                    self.engine.add_request(f"{self.prefix}{i}", tokens,
                                            SamplingParams(max_tokens=req.output_len,
                                                           ignore_eos=True),
                                            arrival_time=req.arrival_s, tenant=req.tenant)
                except InvalidRequestError:
                    if not self.skip_refused:
                        raise
            elif act is not None and act <= self.now:
                self._act(self.actions.popleft())
            else:
                return

    def _act(self, action: ReplayAction) -> None:
        request_id = None if action.request is None else f"{self.prefix}{action.request}"
        try:
            replay_actions.apply(self.engine, action, request_id)
            self.applied += 1
        except EngineError as e:
            self.refusals.append({"action": action.label or action.kind,
                                  "at": round(action.at_s + self.report_offset_s, 3),
                                  "why": str(e)})

    def _step(self) -> bool:
        """One step of the engine; False if it ran none (it only reported requests that
        ended between steps, or nothing could be scheduled)."""
        engine = self.engine
        counters = engine.scheduler.counters
        tokens_before = counters.num_prompt_tokens + counters.num_generation_tokens
        steps_before = engine.step_count
        if self.observer is not None:
            self.observer.before_step(engine, self.now)
        engine.step_core()  # (token ids only: the replay reads no output)
        if engine.step_count == steps_before:
            return False
        self.steps += 1
        batched = counters.num_prompt_tokens + counters.num_generation_tokens - tokens_before
        self.now += self.cost.seconds(engine.last_step_shape or StepShape(prefill_tokens=batched))
        if self.observer is not None:
            self.observer.after_step(engine, self.now)
        used, allocated = slot_usage(engine)
        self.used_sum += used
        self.alloc_sum += allocated
        holding = len(engine.kv.req_to_blocks)
        self.conc_sum += holding
        self.peak = max(self.peak, holding)
        return True


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
