"""What a capacity replay looked like over time, beyond capacity.ReplayResult's
averages: how full the KV pool was, how long requests waited to be scheduled, and how
many prompt tokens the prefix cache served at each request's first admission.

    stats = replay_stats(trace, config, prompts=prompts, on_progress=print)

Times are simulated seconds (capacity.StepCost), as in the replay itself.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.observe.step_cost import DEFAULT_COST, StepCost
from engine.sim.capacity import WarmUp, replay_paged
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sim.replay_actions import ReplayAction
from engine.sim.trace import TraceRequest

TIMELINE_POINTS = 200  # most points of a timeline (peaks are kept: a bucket's maximum)


@dataclass(slots=True)
class ReplayRecorder:
    """A capacity.ReplayObserver: reads the engine around each step of a replay."""
    num_requests: int  # requests in the trace, for progress
    on_progress: Callable[[float], None] | None = None  # fraction of requests finished
    # one entry per step: its simulated start and end, and the state after it
    step_start: list[float] = field(default_factory=list)
    step_end: list[float] = field(default_factory=list)
    gpu_usage: list[float] = field(default_factory=list)  # fraction of GPU blocks held
    cpu_usage: list[float] = field(default_factory=list)  # fraction of CPU blocks held
    waiting: list[int] = field(default_factory=list)  # requests waiting after the step
    # arrival to the start of the first step that scheduled it, per request admitted
    queue_waits: list[float] = field(default_factory=list)
    # arrival to the end of the step that gave it its first token, per request
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # of the requests admitted
    cached_tokens: int = 0  # of which the prefix cache served at first admission
    _seen: int = 0  # requests added to the engine so far
    _live: int = 0  # live requests after the last step
    _unadmitted: dict[str, Request] = field(default_factory=dict)
    _tokenless: dict[str, Request] = field(default_factory=dict)  # no token out yet
    _now: float = 0.0

    def before_step(self, engine: LLMEngine, now: float) -> None:
        live = len(engine.scheduler.requests)
        if live > self._live:  # requests arrived since the last step: they wait
            for request in engine.scheduler.waiting:
                if request.num_cached_tokens is None:
                    self._unadmitted.setdefault(request.request_id, request)
                if not request.output_token_ids:
                    self._tokenless.setdefault(request.request_id, request)
            self._seen += live - self._live
            self._live = live  # (a step may not follow: nothing could run)
        self._now = now

    def after_step(self, engine: LLMEngine, now: float) -> None:
        # num_cached_tokens is set when a request is first admitted (the Request object
        # keeps it even if the request finished within this step). Requests of equal
        # priority, as a replay's all are, are first admitted in arrival order unless a
        # tenants' policy reorders them (a batch share, fairness "vtc"): in order, the
        # look stops at the first one still waiting.
        # A request that ended before it was admitted (an operator's abort, a move to
        # another engine) is never counted.
        scheduler = engine.scheduler
        in_order = scheduler.vtc is None and scheduler.share_cap is None
        admitted = []
        for rid, request in list(self._unadmitted.items()):
            if request.num_cached_tokens is None and request.status.is_finished:
                del self._unadmitted[rid]
                continue
            if request.num_cached_tokens is None:
                if in_order:
                    break
                continue
            admitted.append(rid)
        for rid in admitted:
            request = self._unadmitted.pop(rid)
            self.queue_waits.append(max(0.0, self._now - request.arrival_time))
            self.prompt_tokens += request.num_prompt_tokens
            self.cached_tokens += request.num_cached_tokens
        for rid in [rid for rid, r in self._tokenless.items() if r.output_token_ids]:
            self.ttfts.append(max(0.0, now - self._tokenless.pop(rid).arrival_time))
        for rid in [rid for rid, r in self._tokenless.items() if r.status.is_finished]:
            del self._tokenless[rid]  # (ended with no token: no TTFT)
        self.step_start.append(self._now)
        self.step_end.append(now)
        self.gpu_usage.append(engine.kv.gpu.usage)
        self.cpu_usage.append(engine.kv.cpu.usage)
        self.waiting.append(len(engine.scheduler.waiting))
        self._live = len(engine.scheduler.requests)
        if self.on_progress is not None:
            self.on_progress(min(1.0, (self._seen - self._live) / max(self.num_requests, 1)))

    def timeline(self, points: int = TIMELINE_POINTS) -> dict:
        """{t, gpu, cpu, waiting}: equal slices of simulated time, each slice the most
        of any step that overlaps it (0 where no step ran: the engine was idle)."""
        end = self.step_end[-1] if self.step_end else 0.0
        if end <= 0.0:
            return {"t": [], "gpu": [], "cpu": [], "waiting": []}
        width = end / points
        gpu, cpu, waiting = [0.0] * points, [0.0] * points, [0] * points
        for start, stop, g, c, w in zip(self.step_start, self.step_end, self.gpu_usage,
                                        self.cpu_usage, self.waiting):
            first, last = int(start / width), min(points - 1, int(stop / width))
            for b in range(min(first, points - 1), last + 1):
                gpu[b], cpu[b], waiting[b] = max(gpu[b], g), max(cpu[b], c), max(waiting[b], w)
        return {"t": [round((b + 1) * width, 3) for b in range(points)],
                "gpu": [round(v, 4) for v in gpu], "cpu": [round(v, 4) for v in cpu],
                "waiting": waiting}

    def mean_gpu_usage(self) -> float:
        """Pool occupancy averaged over busy simulated time (each step by its length)."""
        total = sum(e - s for s, e in zip(self.step_start, self.step_end))
        if total <= 0:
            return 0.0
        return sum((e - s) * u for s, e, u in zip(self.step_start, self.step_end,
                                                  self.gpu_usage)) / total


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100)
    return ordered[int(rank) - 1]


def replay_stats(trace: list[TraceRequest], config: EngineConfig,
                 cost: StepCost = DEFAULT_COST, prompts: list[list[int]] | None = None,
                 on_progress: Callable[[float], None] | None = None,
                 pins: list[list[int]] | None = None,
                 actions: list[ReplayAction] | None = None,
                 warmup: WarmUp | None = None) -> dict:
    """Replay the trace (capacity.replay_paged, with its pins, operator actions and
    warm-up) and describe the run as plain JSON: the replay's own figures and, from a
    ReplayRecorder, occupancy over time, queue waits (arrival to first scheduled,
    simulated seconds) and the prefix hit rate at first admission (prompt tokens served
    from the cache / prompt tokens)."""
    recorder = ReplayRecorder(len(trace), on_progress)
    result = replay_paged(trace, config, cost, prompts=prompts, observer=recorder, pins=pins,
                          actions=actions, warmup=warmup)
    output_tokens = sum(r.output_len for r in trace)
    waits = recorder.queue_waits
    return {
        "requests": result.num_requests,
        "sim_seconds": result.sim_seconds,
        "steps": result.steps,
        "output_tokens_per_s": output_tokens / result.sim_seconds if result.sim_seconds else 0.0,
        "kv_usage_mean": recorder.mean_gpu_usage(),
        "kv_usage_peak": max(recorder.gpu_usage, default=0.0),
        "cpu_usage_peak": max(recorder.cpu_usage, default=0.0),
        "slot_utilisation": result.utilisation,
        "preemptions": result.preemptions,
        "swaps_out": result.swaps_out,
        "prefix_hit_rate": (recorder.cached_tokens / recorder.prompt_tokens
                            if recorder.prompt_tokens else 0.0),
        "prefix_lookup_hit_rate": result.prefix_hit_rate,
        # of the tokens looked up, those found on the CPU tier (cpu_prefix_cache)
        "cpu_tier_hit_rate": result.extra.get("cpu_hit_rate", 0.0),
        # and on the disk tier below it (disk_cache_dir)
        "disk_tier_hit_rate": result.extra.get("disk_hit_rate", 0.0),
        "prompt_tokens_computed": result.extra.get("prompt_tokens_computed"),
        # pinned before the trace (as the engine's operators pinned), within the budget
        "pinned_blocks": result.extra.get("pinned_blocks", 0),
        "pins_refused": result.extra.get("pins_refused", 0),
        # the operator actions applied at their times, and those the replay's engine
        # refused ({action, at, why}: its state then was not the engine's)
        "actions_applied": result.extra.get("actions_applied", 0),
        "actions_refused": result.extra.get("actions_refused", []),
        "warmup_requests": result.extra.get("warmup_requests", 0),
        "queue_wait_p50": percentile(waits, 50),
        "queue_wait_p99": percentile(waits, 99),
        "queue_wait_mean": sum(waits) / len(waits) if waits else None,
        "ttft_p50": percentile(recorder.ttfts, 50),
        "ttft_p99": percentile(recorder.ttfts, 99),
        "peak_concurrency": result.peak_concurrency,
        "mean_concurrency": result.mean_concurrency,
        "wall_seconds": result.wall_seconds,
        "timeline": recorder.timeline(),
    }
