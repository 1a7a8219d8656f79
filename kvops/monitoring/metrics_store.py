"""Job latency histograms, finish reasons and the router's regret kept in Redis, so every
web process exports the same counts. The histograms are vLLM's (name, buckets: vLLM's
vllm/v1/metrics/loggers.py), served under vLLM's names by metrics_view.py."""
from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Sequence

from kvops import live

log = logging.getLogger(__name__)

# Bucket upper bounds, vLLM's: seconds to the first token; seconds between tokens (one
# request's mean, or one step's gap); seconds of a phase of a request (queued, prefill,
# decode, all of it).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens a request holds: 1, 2, 5, 10, ... (vLLM stops them at the model's length, which
# the store does not know: metrics_view.py folds the bounds past an engine's
# max_model_len into +Inf).
TOKEN_COUNT_BUCKETS = tuple(float(m * 10 ** e) for e in range(8) for m in (1, 2, 5))
# Per histogram and engine, a hash of per-bucket counts, NOT cumulative: the field of
# the lowest bound at or above the value ("+Inf" past the last) counts it, so a job costs
# one increment per histogram (cumulative counts cost one per bound it is under, most of
# the cost of writing a job's end); read_histograms() adds them up. (Earlier versions'
# "kvops:hist:*" and "kvops:latency:*", with other buckets, are not read.)
HIST_KEY = "kvops:vllm_hist:{name}:{engine}"
ENGINES_KEY = "kvops:latency:engines"
HISTOGRAMS = {"time_to_first_token_seconds": TTFT_BUCKETS,
              "e2e_request_latency_seconds": REQUEST_BUCKETS,
              # from submission to the engine's taking the job
              "request_queue_time_seconds": REQUEST_BUCKETS,
              # from the engine's taking it to its first token, and from there to its end
              "request_prefill_time_seconds": REQUEST_BUCKETS,
              "request_decode_time_seconds": REQUEST_BUCKETS,
              "request_inference_time_seconds": REQUEST_BUCKETS,
              # a request's decode time over its tokens after the first
              "request_time_per_output_token_seconds": TOKEN_GAP_BUCKETS,
              # every gap between a request's steps that gave it tokens (the output
              # processor's Tally; vLLM's time_per_output_token_seconds before 0.11)
              "inter_token_latency_seconds": TOKEN_GAP_BUCKETS,
              "request_prompt_tokens": TOKEN_COUNT_BUCKETS,
              "request_generation_tokens": TOKEN_COUNT_BUCKETS,
              # the max_tokens the request asked for
              "request_max_num_generation_tokens": TOKEN_COUNT_BUCKETS}
# Per engine, finished jobs by finish reason ("stop", "length", "abort"): vLLM's
# request_success
SUCCESS_KEY = "kvops:vllm_success:{engine}"


# Each histogram's bucket fields, its bounds' then "+Inf": the i-th counts a value whose
# bisect_left among the bounds is i (the lowest bound at or above it).
_FIELDS = {name: (*(repr(b) for b in bounds), "+Inf") for name, bounds in HISTOGRAMS.items()}


def bucket_of(name: str, value: float) -> str:
    """The field that counts `value` in histogram `name`."""
    return _FIELDS[name][bisect_left(HISTOGRAMS[name], value)]


@dataclass(slots=True)
class Tally:
    """Observations of histograms not yet in Redis, added up (its owner's thread only)."""
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, field) -> n
    sums: dict[str, float] = field(default_factory=dict)  # key -> sum of values

    def observe(self, name: str, engine: str, value: float) -> None:
        self.observe_many(name, engine, (value,))

    def observe_many(self, name: str, engine: str, values: Sequence[float]) -> None:
        """Many observations of one histogram: a bisection each (the output processor
        times every request of every step)."""
        if not values:
            return
        key = HIST_KEY.format(name=name, engine=engine)
        bounds, fields = HISTOGRAMS[name], _FIELDS[name]
        per_bucket = [0] * len(fields)
        for value in values:
            per_bucket[bisect_left(bounds, value)] += 1
        for i, n in enumerate(per_bucket):
            if n:
                slot = (key, fields[i])
                self.counts[slot] = self.counts.get(slot, 0) + n
        self.sums[key] = self.sums.get(key, 0.0) + sum(values)

    def write(self, pipe) -> None:
        """Its observations, into Redis's pipeline `pipe`."""
        for (key, slot), n in self.counts.items():
            pipe.hincrby(key, slot, n)
        for key, total in self.sums.items():
            pipe.hincrbyfloat(key, "sum", total)


def record_tally(tally: Tally, engine: str) -> None:
    """One engine's observations, in one Redis round trip (best effort)."""
    if not tally.counts:
        return
    try:
        pipe = live.redis_client().pipeline(transaction=False)
        tally.write(pipe)
        pipe.sadd(ENGINES_KEY, engine)
        pipe.execute()
    except Exception as e:
        log.warning("could not record the latencies of engine %s: %s", engine, e)


def _seconds(start, end) -> float | None:
    return None if start is None or end is None else max(0.0, (end - start).total_seconds())


def _observe_job(tally: Tally, job) -> None:
    """A finished job's figures, as vLLM takes a finished request's: queue (submitted to
    taken), prefill (taken to first token), decode (first token to end)."""
    name = job.engine
    queued = _seconds(job.queued_at, job.started_at)
    ttft = _seconds(job.queued_at, job.first_token_at) if job.started_at else None
    e2e = _seconds(job.queued_at, job.finished_at)
    prefill = _seconds(job.started_at, job.first_token_at)
    decode = _seconds(job.first_token_at, job.finished_at)
    for hist, value in (("request_queue_time_seconds", queued),
                        ("time_to_first_token_seconds", ttft),
                        ("e2e_request_latency_seconds", e2e),
                        ("request_prefill_time_seconds", prefill),
                        ("request_decode_time_seconds", decode),
                        ("request_inference_time_seconds",
                         _seconds(job.started_at, job.finished_at))):
        if value is not None:
            tally.observe(hist, name, value)
    if job.finished_at is None:
        return
    generated = job.num_output_tokens or 0
    if decode is not None and generated > 1:
        tally.observe("request_time_per_output_token_seconds", name,
                      decode / (generated - 1))
    tally.observe("request_prompt_tokens", name, job.num_prompt_tokens or 0)
    tally.observe("request_generation_tokens", name, generated)
    max_tokens = (job.params or {}).get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens > 0:
        tally.observe("request_max_num_generation_tokens", name, max_tokens)


def observe_jobs(jobs) -> None:
    """Record finished jobs' latencies, token counts and finish reasons (best effort), in
    one Redis round trip, the batch's observations added up first."""
    if not jobs:
        return
    tally = Tally()
    reasons: dict[tuple[str, str], int] = {}  # (engine, finish reason) -> jobs
    for job in jobs:
        _observe_job(tally, job)
        if job.finished_at and job.finish_reason:
            reasons[job.engine, job.finish_reason] = \
                reasons.get((job.engine, job.finish_reason), 0) + 1
    if not tally.counts and not reasons:
        return
    try:
        pipe = live.redis_client().pipeline(transaction=False)
        tally.write(pipe)
        for (engine, reason), n in reasons.items():
            pipe.hincrby(SUCCESS_KEY.format(engine=engine), reason, n)
        pipe.sadd(ENGINES_KEY, *{job.engine for job in jobs})
        pipe.execute()
    except Exception as e:
        log.warning("could not record latency of jobs %s: %s", [j.pk for j in jobs], e)


ROUTING_KEY = "kvops:routing:regret:{engine}"  # hash: jobs, missed (jobs), tokens


def count_routing(pipe, engine: str, regret_tokens: int) -> None:
    """One routed job (in the router's pipeline): its regret is the prompt tokens the best
    engine held beyond the one chosen (a job that named its engine may have some)."""
    key = ROUTING_KEY.format(engine=engine)
    pipe.hincrby(key, "jobs", 1)
    if regret_tokens > 0:
        pipe.hincrby(key, "missed", 1)
        pipe.hincrby(key, "tokens", regret_tokens)
    pipe.sadd(ENGINES_KEY, engine)


def read_routing() -> dict[str, dict[str, int]]:
    """{engine: {"jobs", "missed", "tokens"}}: jobs routed to it, those another engine
    held more of, and the tokens it held more."""
    client = live.redis_client()
    out = {}
    for engine in sorted(e.decode() for e in client.smembers(ENGINES_KEY)):
        raw = client.hgetall(ROUTING_KEY.format(engine=engine))
        if raw:
            out[engine] = {k: int(raw.get(k.encode(), 0)) for k in ("jobs", "missed", "tokens")}
    return out


def read_histograms() -> dict[str, dict[str, dict[str, float]]]:
    """{histogram name: {engine: {bucket bound or '+Inf': cumulative count, 'sum': sum}}},
    as Prometheus states them (one Redis round trip for all)."""
    client = live.redis_client()
    engines = sorted(e.decode() for e in client.smembers(ENGINES_KEY))
    pipe = client.pipeline(transaction=False)
    for name in HISTOGRAMS:
        for engine in engines:
            pipe.hgetall(HIST_KEY.format(name=name, engine=engine))
    hashes = iter(pipe.execute())
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, bounds in HISTOGRAMS.items():
        out[name] = {}
        for engine in engines:
            raw = {k.decode(): float(v) for k, v in next(hashes).items()}
            if not raw:
                continue
            cumulative, running = {}, 0.0
            for slot in [repr(b) for b in bounds] + ["+Inf"]:
                running += raw.get(slot, 0.0)
                cumulative[slot] = running
            cumulative["sum"] = raw.get("sum", 0.0)
            out[name][engine] = cumulative
    return out


def read_finish_reasons() -> dict[str, dict[str, int]]:
    """{engine: {finish reason: finished jobs}}."""
    client = live.redis_client()
    engines = sorted(e.decode() for e in client.smembers(ENGINES_KEY))
    pipe = client.pipeline(transaction=False)
    for engine in engines:
        pipe.hgetall(SUCCESS_KEY.format(engine=engine))
    return {engine: {k.decode(): int(v) for k, v in raw.items()}
            for engine, raw in zip(engines, pipe.execute()) if raw}
