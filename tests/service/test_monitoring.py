"""deploy/'s Prometheus alert rules and Grafana dashboard name only metrics that
/metrics exports, the Prometheus config loads the rules, and the compose file's
monitoring profile mounts what it provisions."""
import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.django_db(transaction=True)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\bkvops:[a-z0-9_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def scrape(rf, settings) -> str:
    """/metrics as Prometheus scrapes it: with the token."""
    from kvops.metrics_view import metrics

    settings.KVOPS_METRICS_TOKEN = "scrape-secret-2"
    answer = metrics(rf.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-2"))
    assert answer.status_code == 200, answer.content
    return answer.content.decode()


def exported(rf, settings) -> set[str]:
    """Families /metrics declares (its # TYPE lines), and their samples' names."""
    text = scrape(rf, settings)
    families = set(re.findall(r"^# TYPE (kvops:\S+) (\w+)", text, re.M))
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
    assert "kvops:request_queue_time_seconds_bucket" in names  # the queue-wait alert's
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
    from kvops.registry import register_engine

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
