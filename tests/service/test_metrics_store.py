"""Job histograms and finish reasons in Redis (kvops/monitoring/metrics_store.py):
per-bucket counts written per batch, read back as Prometheus's cumulative buckets."""
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import pytest

from kvops import live
from kvops.monitoring import metrics_store

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass
class FakeJob:
    """The fields observe_jobs reads."""
    pk: int
    engine: str
    queued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    num_prompt_tokens: int = 7
    num_output_tokens: int = 10
    finish_reason: str = "length"
    params: dict = field(default_factory=lambda: {"max_tokens": 16})


def job(engine: str, wait: float, ttft: float | None, e2e: float | None, pk: int = 1):
    at = lambda s: None if s is None else T0 + timedelta(seconds=s)  # noqa: E731
    return FakeJob(pk, engine, T0, at(wait), at(ttft), at(e2e))


def read(engine: str) -> dict:
    return {name: per_engine[engine] for name, per_engine
            in metrics_store.read_histograms().items() if engine in per_engine}


def forget(engine: str) -> None:
    redis = live.redis_client()
    redis.delete(*[metrics_store.HIST_KEY.format(name=name, engine=engine)
                   for name in metrics_store.HISTOGRAMS],
                 metrics_store.SUCCESS_KEY.format(engine=engine))
    redis.srem(metrics_store.ENGINES_KEY, engine)


def test_buckets_read_back_cumulative_with_sum_and_count():
    engine = f"hist-{uuid.uuid4().hex[:8]}"
    try:
        metrics_store.observe_jobs([job(engine, 0.02, 0.3, 3.0), job(engine, 0.02, 0.7, 9000.0),
                                    job(engine, 0.5, None, None)])
        hist = read(engine)
        ttft = hist["time_to_first_token_seconds"]
        assert ttft["0.25"] == 0 and ttft["0.5"] == 1 and ttft["0.75"] == 2
        assert ttft["2560.0"] == 2 and ttft["+Inf"] == 2 and abs(ttft["sum"] - 1.0) < 1e-9
        e2e = hist["e2e_request_latency_seconds"]
        assert e2e["2.5"] == 0 and e2e["5.0"] == 1 and e2e["7680.0"] == 1  # 9000 s: past all
        assert e2e["+Inf"] == 2
        wait = hist["request_queue_time_seconds"]
        assert wait["0.3"] == 2 and wait["0.5"] == 3
        assert wait["+Inf"] == 3 and abs(wait["sum"] - 0.54) < 1e-9
        prefill, decode = hist["request_prefill_time_seconds"], hist["request_decode_time_seconds"]
        assert prefill["0.3"] == 1 and prefill["0.8"] == 2 and abs(prefill["sum"] - 0.96) < 1e-9
        assert decode["2.5"] == 0 and decode["5.0"] == 1 and decode["+Inf"] == 2
        tpot = hist["request_time_per_output_token_seconds"]  # 2.7 s over 9 tokens
        assert tpot["0.2"] == 0 and tpot["0.4"] == 1 and tpot["+Inf"] == 2
        assert hist["request_prompt_tokens"]["5.0"] == 0
        assert hist["request_prompt_tokens"]["10.0"] == 2
        assert hist["request_generation_tokens"]["10.0"] == 2
        assert hist["request_max_num_generation_tokens"]["10.0"] == 0
        assert hist["request_max_num_generation_tokens"]["20.0"] == 2
        assert metrics_store.read_finish_reasons()[engine] == {"length": 2}
        for counts in hist.values():  # Prometheus's buckets never decrease
            bounds = [counts[k] for k in counts if k != "sum"]
            assert bounds == sorted(bounds)
    finally:
        forget(engine)


def test_a_batch_counts_as_its_jobs_one_by_one():
    batch, single = (f"hist-{uuid.uuid4().hex[:8]}" for _ in range(2))
    waits = [0.001, 0.03, 0.03, 0.2, 7.0, 100.0]
    try:
        metrics_store.observe_jobs([job(batch, w, w + 0.1, w + 1, pk=i)
                                    for i, w in enumerate(waits)])
        for i, w in enumerate(waits):
            metrics_store.observe_jobs([job(single, w, w + 0.1, w + 1, pk=i)])
        together, one_by_one = read(batch), read(single)
        for name, counts in together.items():
            assert counts == pytest.approx(one_by_one[name])  # sums: float order aside
        assert read(batch)["request_queue_time_seconds"]["+Inf"] == len(waits)
    finally:
        forget(batch)
        forget(single)


def test_a_tally_of_token_gaps_reads_back_as_one_histogram():
    engine = f"hist-{uuid.uuid4().hex[:8]}"
    tally = metrics_store.Tally()
    for gap in (0.005, 0.02, 0.02, 0.3, 100.0):
        tally.observe("inter_token_latency_seconds", engine, gap)
    try:
        metrics_store.record_tally(tally, engine)
        gaps = read(engine)["inter_token_latency_seconds"]
        assert gaps["0.01"] == 1 and gaps["0.025"] == 3 and gaps["0.3"] == 4
        assert gaps["80.0"] == 4 and gaps["+Inf"] == 5 and abs(gaps["sum"] - 100.345) < 1e-9
    finally:
        forget(engine)
