"""deploy/prometheus/rules.yaml and the observability config, checked by the real promtool (Debian's
Prometheus 2.42, fetched once into a cache by tests/support/prometheus.py; skipped where it cannot be):
`promtool check rules`, the rules' unit tests (`promtool test rules deploy/prometheus/rules.test.yaml`),
`promtool check config` on deploy/prometheus.yml with the rule file where compose mounts it. Offline, and
without promtool: every alert has a firing unit test and a line in docs/operations.md; the chart's
PrometheusRule carries exactly that file and passes kubernetes-validate (a CRD: the one warning it may
give, as for ServiceMonitor in test_helm.py); the Grafana dashboard has a row per concern."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.support.prometheus import Tools, Unavailable, dashboard_targets, substitute, tools

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/rules.yaml"
RULE_TESTS = ROOT / "deploy/prometheus/rules.test.yaml"
CONFIG = ROOT / "deploy/prometheus.yml"
DASHBOARD = ROOT / "deploy/grafana/splitserve.json"
CHART = ROOT / "helm/splitserve"
KUBE = "1.30.0"
PROMETHEUS_RULE_CRD = "kind PrometheusRule with api version monitoring.coreos.com/v1"
DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        t: Tools = tools()
    except Unavailable as e:
        pytest.skip(f"no Prometheus/promtool: {e}")
    return t.promtool


def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# ---- promtool ----


def test_promtool_checks_the_rules(promtool: Path) -> None:
    r = run([str(promtool), "check", "rules", str(RULES)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout


def test_the_rules_pass_their_unit_tests(promtool: Path) -> None:
    r = run([str(promtool), "test", "rules", str(RULE_TESTS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


def test_promtool_checks_the_compose_prometheus_config(promtool: Path, tmp_path: Path) -> None:
    """deploy/prometheus.yml, laid out as compose mounts it (the rule file next to it, at the path its
    rule_files names); only the bearer token file, a secret compose makes at start, is a stand-in."""
    cfg = yaml.safe_load(CONFIG.read_text())
    assert cfg["rule_files"] == ["prometheus/rules.yaml"]
    (tmp_path / "prometheus").mkdir()
    shutil.copy(RULES, tmp_path / "prometheus/rules.yaml")
    token = tmp_path / "metrics-key"
    token.write_text("a-stand-in-for-the-metrics-key")
    text = CONFIG.read_text()
    credentials = [
        j["authorization"]["credentials_file"] for j in cfg["scrape_configs"] if "authorization" in j
    ]
    assert credentials == ["/run/secrets/metrics/key"]
    (tmp_path / "prometheus.yml").write_text(text.replace(credentials[0], str(token)))
    r = run([str(promtool), "check", "config", str(tmp_path / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout


def test_compose_mounts_the_rules_where_the_config_names_them() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = {}
    for v in compose["services"]["prometheus"]["volumes"]:
        if isinstance(v, str) and v.startswith("./"):
            source, target = v.split(":")[:2]
            mounts[target] = source
    config_at = Path(next(t for t, s in mounts.items() if s == "./deploy/prometheus.yml"))
    (rule_file,) = yaml.safe_load(CONFIG.read_text())["rule_files"]
    assert mounts[str(config_at.parent / rule_file)] == "./deploy/prometheus/rules.yaml"


# ---- the rules themselves ----


def test_every_alert_has_a_firing_unit_test_severity_annotations_and_docs() -> None:
    ops = (ROOT / "docs/operations.md").read_text()
    fired: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            if t.get("exp_alerts"):
                fired.add(t["alertname"])
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 10
    for a in alerts:
        name = a["alert"]
        assert name in fired, f"{name}: no test in {RULE_TESTS.name} expects it to fire"
        assert a["labels"]["severity"] in ("info", "warning", "critical"), name
        assert a["annotations"]["summary"] and a["annotations"]["description"], name
        assert f"`{name}`" in ops, f"docs/operations.md does not explain {name}"
    for r in rules():
        if "record" in r:  # level:metric:operations, and every recorded series is read by an alert
            assert re.fullmatch(r"splitserve:[a-z0-9_]+:[a-z0-9_]+", r["record"]), r["record"]
            assert any(r["record"] in a["expr"] for a in alerts), f"{r['record']} is read by no alert"


# ---- the chart's PrometheusRule ----


def render(vals: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(vals, name="llm", namespace="serving", is_install=True)


def check_rule(rule: dict[str, Any]) -> None:
    """The PrometheusRule CRD's schema for one rule (monitoring.coreos.com/v1 Rule)."""
    assert set(rule) <= {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
    assert ("record" in rule) != ("alert" in rule), rule
    assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule
    if "for" in rule:
        assert DURATION.match(rule["for"]), rule
    for key in ("labels", "annotations"):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in rule.get(key, {}).items()), rule


def test_the_chart_ships_the_same_rules_as_a_prometheus_rule(tmp_path: Path) -> None:
    assert not any("prometheusrule" in p for p, t in render(None).items() if t.strip())  # off by default
    rendered = render({"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}})
    docs = [
        d
        for p, t in rendered.items()
        if p.endswith(".yaml")
        for d in yaml.safe_load_all(t)
        if d and d["kind"] == "PrometheusRule"
    ]
    (pr,) = docs
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["name"] == "llm-splitserve"
    assert pr["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pr["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"
    assert pr["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]  # the file, as it is
    for group in pr["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}
        for rule in group["rules"]:
            check_rule(rule)
    manifest = tmp_path / "prometheusrule.yaml"
    manifest.write_text(yaml.safe_dump(pr))
    r = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBE, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = r.stdout.splitlines()  # a CRD: kubernetes-validate has no schema, and only warns
    assert PROMETHEUS_RULE_CRD in line, r.stdout
    report = helm.lint(
        str(CHART), {"prometheusRule": {"enabled": True}}, strict=True, kube_version=f"v{KUBE}", namespace="x"
    )
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report


@pytest.mark.parametrize("bad", [{"prometheusRule": {"enabled": "yes"}}, {"prometheusRule": {"label": {}}}])
def test_schema_refuses_bad_prometheus_rule_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="prometheusRule"):
        render(bad)


# ---- the dashboard ----


def test_the_dashboard_has_a_row_per_concern_and_every_query_is_substitutable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Traffic & latency", "KV & transfers", "Fault tolerance", "Security", "KV tiers"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"] and p["description"], p["title"]
    targets = dashboard_targets(dash)
    assert len(targets) >= 40
    for title, expr in targets:
        substitute(expr, dash)  # raises on a variable the test could not fill in
        assert 'role="' not in expr, f"{title}: the chart's scrapes carry no role label: {expr}"
    # where operators look for each concern: the metrics behind each row
    text = json.dumps(dash)
    for name in (
        "splitserve_router_migrations_total",
        "splitserve_router_transfer_failures_total",
        "splitserve_router_shed_total",
        "splitserve_router_orphans_failed",
        "splitserve_router_auth_refused_total",
        "splitserve_router_rate_limited_total",
        "splitserve_router_rate_limits_unenforced_total",
        "splitserve_internal_auth_refused_total",
        "splitserve_kv_transfer_auth_failures_total",
        "splitserve_kv_transfer_failures_total",
        "splitserve_expired_peer_leases_total",
        "splitserve_preemptions_total",
        "splitserve_router_tenant_requests_total",
        "splitserve_router_tenant_tokens_total",
        "splitserve_router_registered_workers",
        "splitserve_kv_tier_verify_failures_total",
        "splitserve_kv_tier_bytes",
    ):
        assert name in text, name
