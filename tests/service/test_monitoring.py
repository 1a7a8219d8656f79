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


def exported(rf) -> set[str]:
    """Families /metrics declares (its # TYPE lines), and their samples' names."""
    from kvops.metrics_view import metrics

    text = metrics(rf.get("/metrics")).content.decode()
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


def test_every_metric_the_rules_and_the_dashboard_name_is_exported(rf):
    names = exported(rf)
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
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")  # no default password
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kvops.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {uid}
