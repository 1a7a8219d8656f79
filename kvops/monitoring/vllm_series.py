"""/metrics' series under vLLM's own names, types and labels (vLLM's
vllm/v1/metrics/loggers.py), so that dashboards and alerts made for vLLM read kvops
unchanged: every series labelled `model_name` (the name clients call the model by) and
`engine` (kvops' engine name, where vLLM has its engine index)."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from kvops import selectors
from kvops.monitoring import metrics_store

LABELS = ["model_name", "engine"]

# (name, engine metrics key, help, kind): the engine's own figures (Reporter.metrics)
ENGINE_SERIES = [
    ("vllm:num_requests_running", "running", "Requests in the running batch.",
     "gauge"),
    ("vllm:num_requests_waiting", "waiting", "Requests waiting to be admitted.",
     "gauge"),
    ("vllm:kv_cache_usage_perc", "kv_usage", "Share of the GPU KV pool in use (1: all of it).",
     "gauge"),
    ("vllm:prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache.", "counter"),
    ("vllm:prefix_cache_hits", "prefix_cache_hits",
     "Prompt tokens found in the prefix cache.", "counter"),
    ("vllm:num_preemptions", "num_preemptions",
     "Requests preempted by recompute (kvops:num_swaps_out counts those "
     "swapped out).", "counter"),
    ("vllm:prompt_tokens", "num_prompt_tokens", "Prompt tokens computed.",
     "counter"),
    ("vllm:generation_tokens", "num_generation_tokens",
     "Output tokens generated.", "counter"),
]

HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Seconds from a request's arrival to its first token.",
    "e2e_request_latency_seconds": "Seconds from a request's arrival to its end.",
    "request_queue_time_seconds": "Seconds a request waited before it first ran.",
    "request_prefill_time_seconds": "Seconds a request spent computing its prompt.",
    "request_decode_time_seconds": "Seconds a request spent generating after its first token.",
    "request_inference_time_seconds": "Seconds a request spent running (prompt and generation).",
    "request_time_per_output_token_seconds":
        "A request's mean seconds per output token after the first.",
    "inter_token_latency_seconds": "Seconds between a request's consecutive output tokens.",
    "request_prompt_tokens": "A request's prompt tokens.",
    "request_generation_tokens": "A request's output tokens.",
    "request_max_num_generation_tokens":
        "Output tokens a request asked for at most (max_tokens).",
}
# counted in tokens: their bounds stop at the engine's max_model_len, as vLLM's do
TOKEN_COUNTS = {"request_prompt_tokens", "request_generation_tokens",
                "request_max_num_generation_tokens"}


def families(engines: list) -> Iterator:
    """Every vLLM-named family, for the engines' rows and the job histograms in Redis."""
    by_name = {engine.name: engine for engine in engines}

    def labels(engine_name: str) -> list[str]:
        engine = by_name.get(engine_name)
        return [selectors.model_name(engine) if engine is not None else "unknown",
                engine_name]

    for name, key, help_text, kind in ENGINE_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, help_text, labels=LABELS)
        for engine in engines:
            if key in (engine.metrics or {}):
                family.add_metric(labels(engine.name), float(engine.metrics[key]))
        yield family
    success = CounterMetricFamily("vllm:request_success",
                                  "Count of successfully processed requests.",
                                  labels=[*LABELS, "finished_reason"])
    for engine_name, reasons in metrics_store.read_finish_reasons().items():
        for reason, n in sorted(reasons.items()):
            success.add_metric([*labels(engine_name), reason], float(n))
    yield success
    for hist_name, per_engine in metrics_store.read_histograms().items():
        family = HistogramMetricFamily(f"vllm:{hist_name}", HISTOGRAM_HELP[hist_name],
                                       labels=LABELS)
        for engine_name, counts in per_engine.items():
            bounds = metrics_store.HISTOGRAMS[hist_name]
            if hist_name in TOKEN_COUNTS:
                bounds = _up_to(bounds, by_name.get(engine_name))
            buckets = [(repr(b), counts[repr(b)]) for b in bounds]
            buckets.append(("+Inf", counts["+Inf"]))
            family.add_metric(labels(engine_name), buckets, sum_value=counts["sum"])
        yield family


def _up_to(bounds: tuple[float, ...], engine) -> tuple[float, ...]:
    """The bounds at or under the engine's max_model_len (vLLM's build_1_2_5_buckets);
    the counts above the last fall into +Inf, which is cumulative already."""
    limit = ((engine.config or {}).get("max_model_len") if engine is not None else None)
    if not isinstance(limit, int | float) or limit <= 0:
        return bounds
    return tuple(b for b in bounds if b <= limit)
