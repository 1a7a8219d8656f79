"""Job latency histograms kept in Redis, so every web process exports the same counts."""
from __future__ import annotations

import logging

from kvops import live

log = logging.getLogger(__name__)

# Bucket upper bounds in seconds (vLLM uses similar ones for TTFT and e2e latency).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
HIST_KEY = "kvops:hist:{name}:{engine}"
HISTOGRAMS = {"time_to_first_token_seconds": TTFT_BUCKETS,
              "e2e_request_latency_seconds": E2E_BUCKETS,
              # from submission to the engine's taking the job (vLLM: request_queue_time)
              "request_queue_time_seconds": TTFT_BUCKETS}


def _observe(pipe, name: str, engine: str, value: float) -> None:
    key = HIST_KEY.format(name=name, engine=engine)
    for bound in HISTOGRAMS[name]:
        if value <= bound:
            pipe.hincrby(key, repr(bound), 1)
    pipe.hincrby(key, "+Inf", 1)
    pipe.hincrbyfloat(key, "sum", value)


def observe_jobs(jobs) -> None:
    """Record finished jobs' queue wait, TTFT and end-to-end latency (best effort), in
    one Redis round trip."""
    if not jobs:
        return
    try:
        pipe = live.redis_client().pipeline(transaction=False)
        for job in jobs:
            if job.started_at:
                _observe(pipe, "request_queue_time_seconds", job.engine,
                         max(0.0, (job.started_at - job.queued_at).total_seconds()))
            if job.first_token_at and job.started_at:
                _observe(pipe, "time_to_first_token_seconds", job.engine,
                         (job.first_token_at - job.queued_at).total_seconds())
            if job.finished_at:
                _observe(pipe, "e2e_request_latency_seconds", job.engine,
                         (job.finished_at - job.queued_at).total_seconds())
        pipe.sadd("kvops:hist:engines", *{job.engine for job in jobs})
        pipe.execute()
    except Exception as e:
        log.warning("could not record latency of jobs %s: %s", [j.pk for j in jobs], e)


def read_histograms() -> dict[str, dict[str, dict[str, float]]]:
    """{histogram name: {engine: {bucket bound or 'sum': value}}}."""
    client = live.redis_client()
    engines = sorted(e.decode() for e in client.smembers("kvops:hist:engines"))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in HISTOGRAMS:
        out[name] = {}
        for engine in engines:
            raw = client.hgetall(HIST_KEY.format(name=name, engine=engine))
            if raw:
                out[name][engine] = {k.decode(): float(v) for k, v in raw.items()}
    return out
