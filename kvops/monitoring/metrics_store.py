"""Job latency histograms and the router's regret kept in Redis, so every web process
exports the same counts."""
from __future__ import annotations

import logging

from kvops import live

log = logging.getLogger(__name__)

# Bucket upper bounds in seconds (vLLM uses similar ones for TTFT and e2e latency).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Per histogram and engine, a hash of per-bucket counts, NOT cumulative: the field of
# the lowest bound at or above the value ("+Inf" past the last) counts it, so a job costs
# one increment per histogram (cumulative counts cost one per bound it is under, about 40
# Redis commands a job, most of the cost of writing a job's end); read_histograms() adds
# them up. ("kvops:hist:*", the cumulative hashes of earlier versions, are not read.)
HIST_KEY = "kvops:latency:{name}:{engine}"
ENGINES_KEY = "kvops:latency:engines"
HISTOGRAMS = {"time_to_first_token_seconds": TTFT_BUCKETS,
              "e2e_request_latency_seconds": E2E_BUCKETS,
              # from submission to the engine's taking the job (vLLM: request_queue_time)
              "request_queue_time_seconds": TTFT_BUCKETS}


def bucket_of(name: str, value: float) -> str:
    """The field that counts `value` in histogram `name`."""
    return next((repr(b) for b in HISTOGRAMS[name] if value <= b), "+Inf")


def observe_jobs(jobs) -> None:
    """Record finished jobs' queue wait, TTFT and end-to-end latency (best effort), in
    one Redis round trip, the batch's observations added up first."""
    if not jobs:
        return
    counts: dict[tuple[str, str], int] = {}  # (key, field) -> observations
    sums: dict[str, float] = {}  # key -> sum of values

    def observe(name: str, engine: str, value: float) -> None:
        key = HIST_KEY.format(name=name, engine=engine)
        field = (key, bucket_of(name, value))
        counts[field] = counts.get(field, 0) + 1
        sums[key] = sums.get(key, 0.0) + value

    for job in jobs:
        if job.started_at:
            observe("request_queue_time_seconds", job.engine,
                    max(0.0, (job.started_at - job.queued_at).total_seconds()))
        if job.first_token_at and job.started_at:
            observe("time_to_first_token_seconds", job.engine,
                    (job.first_token_at - job.queued_at).total_seconds())
        if job.finished_at:
            observe("e2e_request_latency_seconds", job.engine,
                    (job.finished_at - job.queued_at).total_seconds())
    if not counts:
        return
    try:
        pipe = live.redis_client().pipeline(transaction=False)
        for (key, field), n in counts.items():
            pipe.hincrby(key, field, n)
        for key, total in sums.items():
            pipe.hincrbyfloat(key, "sum", total)
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
    as Prometheus states them."""
    client = live.redis_client()
    engines = sorted(e.decode() for e in client.smembers(ENGINES_KEY))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, bounds in HISTOGRAMS.items():
        out[name] = {}
        for engine in engines:
            raw = {k.decode(): float(v) for k, v in
                   client.hgetall(HIST_KEY.format(name=name, engine=engine)).items()}
            if not raw:
                continue
            cumulative, running = {}, 0.0
            for field in [repr(b) for b in bounds] + ["+Inf"]:
                running += raw.get(field, 0.0)
                cumulative[field] = running
            cumulative["sum"] = raw.get("sum", 0.0)
            out[name][engine] = cumulative
    return out
