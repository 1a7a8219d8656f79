"""/metrics serves every series vLLM's shipped Grafana dashboard queries, under vLLM's
names and labels, so that dashboard works unchanged (kvops/monitoring/vllm_series.py)."""
import re

import pytest

from tests.support.wait import wait_until

# The series the queries of vLLM's dashboard name: vllm-project/vllm,
# examples/observability/prometheus_grafana/grafana.json at commit
# 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (each series as the queries write it).
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# Beside them, what vLLM's metrics documentation names for the same figures
ALSO_SERVED = [
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_inference_time_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
]
SAMPLE = re.compile(r"^(vllm:[a-z0-9_]+)(?:\{([^}]*)\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """/metrics' vllm: samples: (name, labels, value)."""
    return [(name, dict(LABEL.findall(labels or "")), float(value))
            for name, labels, value in SAMPLE.findall(text)]


@pytest.fixture(scope="module")
def scraped(stack) -> str:
    """/metrics once a streamed job of several tokens has run on the simulated engine, and
    the gaps between its tokens have reached Redis (the output processor writes them
    with its next progress write, after the job's end)."""
    job = stack.api("POST", "/api/jobs/", json={"prompt": "for vLLM's dashboard",
                                                "max_tokens": 12}).json()
    assert stack.wait_job(job["id"])["status"] == "finished"

    def scrape() -> str:
        return stack.api("GET", "/metrics").text

    return wait_until(scrape, "the inter-token gaps in /metrics", 30,
                      until=lambda text: re.search(
                          r'^vllm:inter_token_latency_seconds_count\{[^}]*engine="sim"[^}]*\} '
                          r'[1-9]', text, re.M), poll_s=0.1)


def test_every_series_of_vllms_dashboard_is_served(scraped):
    names = {name for name, _, _ in samples(scraped)}
    missing = [n for n in DASHBOARD_SERIES + ALSO_SERVED if n not in names]
    assert not missing, missing
    reasons = {labels["finished_reason"] for name, labels, _ in samples(scraped)
               if name == "vllm:request_success_total" and labels["engine"] == "sim"}
    assert "length" in reasons  # max_tokens reached


def test_every_vllm_series_names_its_model(scraped):
    found = samples(scraped)
    assert found
    for name, labels, _ in found:
        assert labels.get("model_name"), (name, labels)
    sim = {labels["model_name"] for _, labels, _ in found if labels.get("engine") == "sim"}
    assert sim == {"simulated-v1"}


@pytest.mark.parametrize("histogram", ["vllm:time_to_first_token_seconds",
                                       "vllm:inter_token_latency_seconds",
                                       "vllm:request_generation_tokens"])
def test_a_histogram_is_cumulative_and_ends_in_inf(scraped, histogram):
    of_sim = {}  # sample name -> [(labels, value)], the simulated engine's
    for name, labels, value in samples(scraped):
        if labels.get("engine") == "sim" and name.startswith(histogram + "_"):
            of_sim.setdefault(name, []).append((labels, value))
    buckets = [(labels["le"], value) for labels, value in of_sim[histogram + "_bucket"]]
    assert buckets[-1][0] == "+Inf"
    bounds = [float(le) for le, _ in buckets]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    counts = [value for _, value in buckets]
    assert counts == sorted(counts)  # cumulative: never falling
    [(_, count)] = of_sim[histogram + "_count"]
    [(_, total)] = of_sim[histogram + "_sum"]
    assert count == counts[-1] >= 1 and total > 0
