"""deploy/'s Prometheus alert rules and Grafana dashboard name only metrics that
/metrics exports, the tier alerts judge /metrics' counters as the engine page judges the
same counters, the Prometheus config loads the rules, and the compose file's monitoring
profile mounts what it provisions."""
import ast
import json
import operator
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# what the engine page judges (tests/dashboard/js/tiers.test.mjs checks it on them)
TIER_CASES = ROOT / "tests" / "dashboard" / "js" / "tier_health_cases.json"
METRIC = re.compile(r"\b(?:kvops|vllm):[a-z0-9_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def scrape(rf, settings) -> str:
    """/metrics as Prometheus scrapes it: with the token."""
    from kvops.monitoring.metrics_view import metrics

    settings.KVOPS_METRICS_TOKEN = "scrape-secret-2"
    answer = metrics(rf.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-2"))
    assert answer.status_code == 200, answer.content
    return answer.content.decode()


def exported(rf, settings) -> set[str]:
    """Families /metrics declares (its # TYPE lines), and their samples' names."""
    text = scrape(rf, settings)
    families = set(re.findall(r"^# TYPE ((?:kvops|vllm):\S+) (\w+)", text, re.M))
    names = set()
    for family, kind in families:
        names.add(family)
        if kind == "counter":
            names.add(family + "_total")
        if kind == "histogram":
            names |= {family + s for s in ("_bucket", "_sum", "_count")}
    return names


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "dashboards" / "kvops.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"]]
    return exprs


def test_every_metric_the_rules_and_the_dashboard_name_is_exported(rf, settings):
    names = exported(rf, settings)
    assert "vllm:request_queue_time_seconds_bucket" in names  # the queue-wait alert's
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"KVOpsEngineDown", "KVOpsKVCacheFull",
                                            "KVOpsPreemptionStorm", "KVOpsPrefixHitRateCollapsed",
                                            "KVOpsQueueWaitHigh", "KVOpsCPUTierNeverHits",
                                            "KVOpsDiskTierNeverHits",
                                            "KVOpsDiskTierChecksumFailures"}
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used and used <= names, (rule["alert"], used - names)
        assert rule["for"] and rule["annotations"]["summary"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(METRIC.findall(expr))
        assert used and used <= names, (expr, used - names)


INCREASE = re.compile(r"increase\(((?:kvops|vllm):[a-z0-9_]+)\[\w+\]\)")
COMPARE = {ast.Gt: operator.gt, ast.Lt: operator.lt, ast.GtE: operator.ge,
           ast.LtE: operator.le, ast.Eq: operator.eq, ast.NotEq: operator.ne}
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def fires(expr: str, samples: dict[str, float]) -> bool:
    """Whether a rule of `increase(counter[range])` terms, numbers, arithmetic and
    comparisons joined by and/or fires for one engine whose counters grew from 0 to
    `samples` (so each increase is the sample). A counter the engine does not export is
    no series: a comparison on it is no result, as in PromQL. Anything else in the rule
    is not evaluated here, and fails the test rather than pass unread."""
    names: list[str] = []

    def term(match: re.Match) -> str:
        names.append(match.group(1))
        return f"_{len(names) - 1}"

    try:
        tree = ast.parse(INCREASE.sub(term, " ".join(expr.split())), mode="eval")
    except SyntaxError:
        raise AssertionError(f"{expr!r} is not evaluated here") from None

    def value(node):
        if isinstance(node, ast.Name) and re.fullmatch(r"_\d+", node.id):
            return samples.get(names[int(node.id[1:])])
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            left, right = value(node.left), value(node.right)
            return None if left is None or right is None else \
                ARITHMETIC[type(node.op)](left, right)
        raise AssertionError(f"{expr!r}: {ast.unparse(node)} is not evaluated here")

    def truth(node) -> bool:
        if isinstance(node, ast.BoolOp):
            parts = [truth(v) for v in node.values]
            return all(parts) if isinstance(node.op, ast.And) else any(parts)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and \
                type(node.ops[0]) in COMPARE:
            left, right = value(node.left), value(node.comparators[0])
            return left is not None and right is not None and \
                COMPARE[type(node.ops[0])](left, right)
        raise AssertionError(f"{expr!r}: {ast.unparse(node)} is not evaluated here")

    return truth(tree.body)


def engine_samples(rf, settings, name: str) -> dict[str, float]:
    """The engine's samples in /metrics, by name (a counter's with its _total)."""
    line = re.compile(r'^((?:kvops|vllm):[a-z0-9_]+)\{engine="' + re.escape(name)
                      + r'"(?:,model_name="[^"]*")?\} (\S+)$', re.M)
    return {metric: float(v) for metric, v in line.findall(scrape(rf, settings))}


def engine_with(name: str, metrics: dict) -> None:
    from kvops.engines.registry import heartbeat, register_engine

    register_engine(name, "w", "h", f"i-{name}", {"block_size": 16}, "s1")
    heartbeat(name, f"i-{name}", metrics)


def test_the_tier_alerts_warn_as_the_engine_page_does(rf, settings):
    """Each case's counters (the growth the engine page judges, and warns of as its
    `warn` says: tests/dashboard/js/tiers.test.mjs) through /metrics: the shipped tier
    rules fire for exactly the tiers the page warns of."""
    rules = {r["alert"]: r["expr"] for r in alert_rules()}
    tier_rules = {"cpu": rules["KVOpsCPUTierNeverHits"], "disk": rules["KVOpsDiskTierNeverHits"]}
    cases = json.loads(TIER_CASES.read_text())["cases"]
    assert len(cases) >= 5
    for k, case in enumerate(cases):
        name = f"tiers{k}"
        engine_with(name, case["counters"])
        samples = engine_samples(rf, settings, name)
        fired = [tier for tier, expr in tier_rules.items() if fires(expr, samples)]
        assert fired == case["warn"], (case["name"], fired)


def test_the_rule_evaluator_reads_what_it_is_given():
    """fires() itself: arithmetic, and/or, an absent counter."""
    s = {"kvops:a_total": 5.0, "kvops:b_total": 2.0}
    assert fires("increase(kvops:a_total[1h]) - increase(kvops:b_total[1h]) == 3", s)
    assert not fires("increase(kvops:a_total[1h]) > 0 and increase(kvops:b_total[1h]) == 0", s)
    assert fires("increase(kvops:a_total[1h]) > 9 or increase(kvops:b_total[1h]) > 1", s)
    assert not fires("increase(kvops:gone_total[1h]) == 0", s)
    for unread in ("absent(kvops:a_total) == 1", "increase(kvops:a_total[1h]) > bool 0",
                   "increase(kvops:a_total[1h]) unless increase(kvops:b_total[1h]) > 0"):
        with pytest.raises(AssertionError, match="not evaluated"):
            fires(unread, s)


def test_prompt_tokens_by_source_add_each_tiers_own_hits(rf, settings):
    """external_kv_transfer is the CPU tier's hits and the disk's, each its own counter,
    wherever the disk sits (the engine counts a block the disk read back through the CPU
    tier as the disk's only)."""
    base = {"prefix_cache_queries": 1000, "prefix_cache_hits": 400, "disk_prefix_cache_hits": 150}
    engine_with("below-cpu", {**base, "cpu_prefix_cache_hits": 100, "disk_tier_below": "cpu"})
    engine_with("below-gpu", {**base, "cpu_prefix_cache_hits": 0, "disk_tier_below": "gpu"})
    text = scrape(rf, settings)

    def sources(name: str) -> dict[str, float]:
        line = re.compile(r'^kvops:prompt_tokens_by_source_total\{engine="' + name
                          + r'",source="(\w+)"\} (\S+)$', re.M)
        return {source: float(v) for source, v in line.findall(text)}

    assert sources("below-cpu") == {"local_compute": 600.0, "local_cache_hit": 150.0,
                                    "external_kv_transfer": 250.0}
    assert sources("below-gpu") == {"local_compute": 600.0, "local_cache_hit": 250.0,
                                    "external_kv_transfer": 150.0}


def test_prometheus_loads_the_rules_and_compose_mounts_them():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["web:8000"]
    compose = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())["services"]
    prometheus, grafana = compose["prometheus"], compose["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    for svc in (prometheus, grafana):
        for volume in svc["volumes"]:
            source = volume.split(":")[0]
            assert (DEPLOY.parent / source).exists(), source
    assert any(v.endswith(":/etc/prometheus/alerts.yml:ro") for v in prometheus["volumes"])
    # /metrics answers no one without its token: Prometheus reads it from the compose
    # secret that holds the web's KVOPS_METRICS_TOKEN
    [job] = config["scrape_configs"]
    token_file = job["authorization"]["credentials_file"]
    [secret] = prometheus["secrets"]
    assert token_file == f"/run/secrets/{secret}"
    compose_doc = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())
    assert compose_doc["secrets"][secret] == {"environment": "KVOPS_METRICS_TOKEN"}
    assert compose["web"]["environment"]["KVOPS_METRICS_TOKEN"].startswith(
        "${KVOPS_METRICS_TOKEN")
    assert "KVOPS_METRICS_PUBLIC" not in compose["web"]["environment"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")  # no default password
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kvops.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {uid}


def test_cache_config_info_names_each_engines_kv_dtype_and_block_bytes(rf, settings):
    from kvops.engines.registry import register_engine

    register_engine("fp8", "w1", "h", "i1", {"block_size": 16, "dtype": "bfloat16",
                                           "kv_cache_dtype": "fp8_e4m3",
                                           "kv_format": "float8_e4m3fn/tensor:0a1b2c3d",
                                           "num_gpu_blocks": 9000, "num_cpu_blocks": 0,
                                           "kv_bytes_per_block": 147456}, "s1")
    register_engine("plain", "w2", "h", "i2", {"block_size": 16, "dtype": "bfloat16",
                                             "kv_cache_dtype": "auto", "kv_format": "bfloat16",
                                             "num_gpu_blocks": 4500, "num_cpu_blocks": 0,
                                             "kv_bytes_per_block": 294912}, "s1")
    text = scrape(rf, settings)
    lines = {line.split("engine=\"")[1].split("\"")[0]: line for line in text.splitlines()
             if line.startswith("kvops:cache_config_info{")}
    assert 'cache_dtype="fp8_e4m3"' in lines["fp8"] and 'kv_bytes_per_block="147456"' in lines["fp8"]
    assert 'kv_format="float8_e4m3fn/tensor:0a1b2c3d"' in lines["fp8"]
    assert 'cache_dtype="bfloat16"' in lines["plain"] and 'num_gpu_blocks="4500"' in lines["plain"]
    assert lines["plain"].endswith(" 1.0")


def test_the_kv_by_tenant_gauges_name_the_top_tenants_and_other_only(rf, settings):
    """More tenants than the engine names: /metrics has its top ones and `other`, N + 1
    `tenant` labels, and staff's requests (no tenant label) under `staff`."""
    from engine.kv.block_seconds import TenantKV
    from engine.observe.tenants import kv_by_tenant

    meter = {f"{t:016x}": TenantKV(gpu=t, gpu_s=10.0 * t) for t in range(1, 7)}
    meter[None] = TenantKV(gpu=20, cpu=2, gpu_s=5.0)
    engine_with("tenants", {"kv_by_tenant": kv_by_tenant(meter, {f"{6:016x}": 4}, top=3)})
    text = scrape(rf, settings)
    line = re.compile(r'^kvops:tenant_kv_blocks\{engine="tenants",pool="(\w+)",tenant="(\w+)"\} (\S+)$',
                      re.M)
    blocks = {(tenant, pool): float(v) for pool, tenant, v in line.findall(text)}
    assert {tenant for tenant, _ in blocks} == {"staff", f"{6:016x}", f"{5:016x}", "other"}
    assert blocks["staff", "gpu"] == 20 and blocks["staff", "cpu"] == 2
    assert blocks[f"{6:016x}", "cached"] == 4
    assert blocks["other", "gpu"] == 1 + 2 + 3 + 4  # the four tenants beyond the top 3
    seconds = re.findall(r'^kvops:tenant_kv_block_seconds\{engine="tenants",pool="gpu",'
                         r'tenant="other"\} (\S+)$', text, re.M)
    assert [float(s) for s in seconds] == [100.0]
