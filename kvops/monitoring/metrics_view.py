"""GET /metrics: Prometheus text. What vLLM also measures, under vLLM's names and labels
(vllm_series.py: vLLM's dashboards work unchanged); kvops' own figures (tiers, swaps,
the KV story, routing) as kvops:..., labelled by engine."""
from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from engine.observe.tenants import STAFF_TENANT
from kvops import selectors
from kvops.monitoring import metrics_store, vllm_series
from kvops.monitoring.health import signed_in_user
from kvops.models import Job

# (metric, engine metrics key, help, kind)
ENGINE_METRICS = [
    ("kvops:cpu_kv_cache_usage_perc", "cpu_kv_usage", "Fraction of CPU swap blocks in use.", "gauge"),
    ("kvops:num_requests_swapped", "swapped", "Requests swapped out to CPU memory.", "gauge"),
    ("kvops:cpu_prefix_cache_hits", "cpu_prefix_cache_hits",
     "Prompt tokens found on the CPU tier of the prefix cache (copied in, not recomputed); "
     "its own hits: blocks the disk tier read back into it count in "
     "kvops:disk_prefix_cache_hits only.", "counter"),
    ("kvops:cpu_cache_copy_out_bytes", "cpu_cache_copy_out_bytes",
     "Bytes the CPU tier copied from GPU blocks about to be reused.", "counter"),
    ("kvops:cpu_cache_copy_in_bytes", "cpu_cache_copy_in_bytes",
     "Bytes the CPU tier copied back into GPU blocks on prefix hits.", "counter"),
    ("kvops:disk_prefix_cache_hits", "disk_prefix_cache_hits",
     "Prompt tokens found on the disk tier of the prefix cache (read back, not recomputed; "
     "never in kvops:cpu_prefix_cache_hits, even where they come through the CPU tier).",
     "counter"),
    ("kvops:disk_cache_blocks", "num_disk_cached_blocks", "Blocks the disk tier holds.",
     "gauge"),
    ("kvops:disk_cache_bytes_used", "disk_cache_bytes_used", "Bytes the disk tier's files take.",
     "gauge"),
    ("kvops:disk_cache_write_bytes", "disk_cache_write_bytes",
     "Bytes of K/V the disk tier wrote.", "counter"),
    ("kvops:disk_cache_read_bytes", "disk_cache_read_bytes",
     "Bytes of K/V the disk tier read back.", "counter"),
    ("kvops:disk_cache_checksum_failures", "disk_cache_checksum_failures",
     "Disk tier blocks that failed their checks: not opened by the disk key (altered, "
     "forged, another model's) or not a regular file (misses, deleted).",
     "counter"),
    ("kvops:disk_cache_write_failures", "disk_cache_write_failures",
     "Disk tier blocks whose write failed (a full disk, an I/O error): not kept.",
     "counter"),
    ("kvops:num_swaps_out", "num_swaps_out", "Requests swapped out to CPU memory.", "counter"),
    ("kvops:num_swaps_in", "num_swaps_in", "Requests swapped back in.", "counter"),
    ("kvops:engine_steps", "num_steps", "Engine steps run.", "counter"),
    ("kvops:engine_step_seconds", "step_seconds",
     "Wall seconds spent in engine steps (schedule, forward, update); divided by "
     "kvops:engine_steps, the mean step time.", "counter"),
]


class _Collector:
    def collect(self):
        engines = list(selectors.engines())
        for name, key, help_text, kind in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=["engine"])
            for engine in engines:
                if key in engine.metrics:
                    family.add_metric([engine.name], float(engine.metrics[key]))
            yield family
        up = GaugeMetricFamily("kvops:engine_up", "1 if the engine's heartbeat is fresh.",
                               labels=["engine"])
        for engine in engines:
            up.add_metric([engine.name], 1.0 if selectors.engine_alive(engine) else 0.0)
        yield up
        yield _cache_config_info(engines)
        jobs = GaugeMetricFamily("kvops:jobs", "Jobs by status.", labels=["status"])
        for status in Job.Status.values:
            jobs.add_metric([status], Job.objects.filter(status=status).count())
        yield jobs
        yield from _kv_story_families(engines)
        yield from _tenant_families(engines)
        yield from vllm_series.families(engines)


def _cache_config_info(engines) -> GaugeMetricFamily:
    """How each engine stores K/V (as vLLM's cache_config_info): 1, labelled with the
    K/V dtype, its format (an fp8 cache's scales), block size, pool sizes and one
    block's bytes, so that capacity queries can divide by them."""
    labels = ["engine", "cache_dtype", "kv_format", "block_size", "num_gpu_blocks",
              "num_cpu_blocks", "kv_bytes_per_block"]
    info = GaugeMetricFamily("kvops:cache_config_info", "How the engine stores K/V.",
                             labels=labels)
    for engine in engines:
        config = engine.config or {}
        if "block_size" not in config:
            continue
        dtype = config.get("kv_cache_dtype") or "auto"
        info.add_metric([engine.name, config.get("dtype", "") if dtype == "auto" else dtype,
                         str(config.get("kv_format") or ""), str(config["block_size"]),
                         str(config.get("num_gpu_blocks", "")), str(config.get("num_cpu_blocks", "")),
                         str(config.get("kv_bytes_per_block") or 0)], 1.0)
    return info


# The KV history's block residency histograms (vLLM's names), sampled in the engine
RESIDENCY = [
    ("kv_block_lifetime_seconds", "Seconds from a block's store in the prefix cache to its "
     "eviction (sampled: EngineConfig.kv_metrics_sample)."),
    ("kv_block_idle_before_evict_seconds", "Seconds from a block's store or last hit to its "
     "eviction (sampled)."),
    ("kv_block_reuse_gap_seconds", "Seconds between a block's store or hit and its next hit "
     "(sampled)."),
]
def _from_outside(m: dict) -> float:
    """Prompt tokens whose K/V came from outside the GPU pool: each lower tier's own hits
    (wherever the disk sits, its hits are counted in its counter only)."""
    return m.get("cpu_prefix_cache_hits", 0) + m.get("disk_prefix_cache_hits", 0)


# prompt tokens by where their K/V came from, as vLLM labels them (a lower tier is the
# transfer from outside the GPU pool)
SOURCES = [("local_compute", lambda m: m["prefix_cache_queries"] - m["prefix_cache_hits"]),
           ("local_cache_hit", lambda m: m["prefix_cache_hits"] - _from_outside(m)),
           ("external_kv_transfer", _from_outside)]


# the `tenant` label of requests without a tenant label (staff's: as GET /api/usage/ says)
# and of the tenants the engine added up (beyond its top ones); a label is 16 hex digits
OTHER_TENANTS = "other"


def _tenant_families(engines):
    """The KV held by tenant (engine/observe/tenants.py), as the engine bounded it: its top
    tenants by blocks and `other`, so at most top + 1 `tenant` labels an engine."""
    held = GaugeMetricFamily(
        "kvops:tenant_kv_blocks", "KV blocks a tenant's live requests hold now, by pool "
        "(a block shared by several requests counts for each), and the cached blocks its "
        "requests computed: the GPU pool's (pool=\"cached\"), the CPU tier's "
        "(pool=\"cpu_cached\") and the disk's (pool=\"disk_cached\", those written since "
        "the engine started).", labels=["engine", "tenant", "pool"])
    seconds = GaugeMetricFamily(
        "kvops:tenant_kv_block_seconds", "KV blocks held x seconds by a tenant's requests "
        "since the engine started, by pool. A gauge: a tenant that leaves the top ones moves "
        "into tenant=\"other\"; take increase() per tenant over spans where it stayed.",
        labels=["engine", "tenant", "pool"])
    for engine in engines:
        by_tenant = (engine.metrics or {}).get("kv_by_tenant") or {}
        rows = [(row["tenant"] or STAFF_TENANT, row) for row in by_tenant.get("tenants") or ()]
        if by_tenant.get("other"):
            rows.append((OTHER_TENANTS, by_tenant["other"]))
        for tenant, row in rows:
            for pool, key in (("gpu", "gpu_blocks"), ("cpu", "cpu_blocks"),
                              ("cached", "cached_blocks"), ("cpu_cached", "cpu_cached_blocks"),
                              ("disk_cached", "disk_cached_blocks")):
                held.add_metric([engine.name, tenant, pool], float(row.get(key, 0)))
            for pool in ("gpu", "cpu"):
                seconds.add_metric([engine.name, tenant, pool], float(row["block_seconds"][pool]))
    yield held
    yield seconds


def _refusal(request: HttpRequest) -> JsonResponse | None:
    """None if the caller may read the metrics, else the JSON 401 or 403 saying why."""
    if settings.KVOPS_METRICS_PUBLIC:
        return None
    token = settings.KVOPS_METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and \
            hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    user = signed_in_user(request)
    if user is not None and user.is_staff:
        return None
    how = ("send `Authorization: Bearer <KVOPS_METRICS_TOKEN>`" if token
           else "set KVOPS_METRICS_TOKEN on the server and send it as "
                "`Authorization: Bearer <token>`")
    if user is not None:
        return JsonResponse({"error": f"/metrics is for staff and scrapers: {how}"},
                            status=403)
    response = JsonResponse({"error": f"/metrics needs a token: {how}, or sign in as staff"},
                            status=401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def _kv_story_families(engines):
    """Preemptions and missed prompt tokens by reason, prompt tokens by source, block
    residency, and the router's regret."""
    by_reason = CounterMetricFamily(
        "kvops:num_preemptions_by_reason", "Preemptions (recompute; swaps are "
        "kvops:num_swaps_out) by cause: kv_full, priority, fairness, operator.",
        labels=["engine", "reason"])
    missed = CounterMetricFamily(
        "kvops:missed_prompt_tokens_by_reason", "Prompt tokens computed at admission, by why "
        "the first block that missed was not cached (a full hit's: partial_block).",
        labels=["engine", "reason"])
    sources = CounterMetricFamily(
        "kvops:prompt_tokens_by_source", "Prompt tokens at admission by where their K/V "
        "came from: computed, the GPU prefix cache, a lower tier (CPU or disk).", labels=["engine", "source"])
    residency = {name: HistogramMetricFamily(f"kvops:{name}", text, labels=["engine"])
                 for name, text in RESIDENCY}
    for engine in engines:
        m = engine.metrics or {}
        for reason, n in sorted((m.get("preemptions_by_reason") or {}).items()):
            by_reason.add_metric([engine.name, reason], float(n))
        for reason, n in sorted((m.get("missed_tokens_by_reason") or {}).items()):
            missed.add_metric([engine.name, reason], float(n))
        if "prefix_cache_queries" in m:
            for source, value in SOURCES:
                sources.add_metric([engine.name, source], float(value(m)))
        for name, family in residency.items():
            h = m.get(name)
            if h:
                running, buckets = 0, []
                for bound, count in zip(h["bounds"] + ["+Inf"], h["counts"]):
                    running += count
                    buckets.append((repr(float(bound)) if bound != "+Inf" else bound, running))
                family.add_metric([engine.name], buckets, sum_value=h["sum"])
    yield from (by_reason, missed, sources, *residency.values())
    regret = CounterMetricFamily(
        "kvops:routing_regret_tokens", "Prompt tokens the best engine held beyond the one a "
        "job went to (the router's regret; a job that named its engine may have some).",
        labels=["engine"])
    misses = CounterMetricFamily(
        "kvops:routing_misses", "Jobs that went to an engine holding less of their prefix "
        "than another did.", labels=["engine"])
    for engine, counts in metrics_store.read_routing().items():
        regret.add_metric([engine], float(counts["tokens"]))
        misses.add_metric([engine], float(counts["missed"]))
    yield regret
    yield misses


def metrics(request: HttpRequest) -> HttpResponse:
    """Answered to a scraper sending `Authorization: Bearer <KVOPS_METRICS_TOKEN>`
    (Prometheus: `authorization: {credentials_file: ...}` in the scrape config) and to
    staff (a session or an API token); to anyone under KVOPS_METRICS_PUBLIC. Its counters
    move with every user's requests (a `salt` miss with each guess of another tenant's
    prompt: docs/security.md), so it is an operator channel."""
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return HttpResponse(generate_latest(registry),
                        content_type="text/plain; version=0.0.4; charset=utf-8")
