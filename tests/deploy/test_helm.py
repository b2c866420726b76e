"""helm/splitserve, offline: linted strictly and rendered by Helm's own Go SDK (helm-python-sdk binds
libhelm_c, shipped in its wheel: no helm binary, no cluster, no network), every rendered manifest
checked by `kubernetes-validate --strict` against the Kubernetes 1.30 schemas shipped in its wheel,
and the renders held against what the values asked for.

ServiceMonitor is a CRD (Prometheus Operator): kubernetes-validate ships schemas for built-in kinds
only and merely warns about others. The test therefore accepts that one warning for ServiceMonitor
alone (any other unknown kind fails) and checks the ServiceMonitor's structure itself."""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from common.config import EngineConfig, ServiceConfig
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm/splitserve"
KUBE = "1.30.0"
RELEASE, NAMESPACE = "llm", "serving"
FULL = "llm-splitserve"
VALUE_SETS = {
    "default": None,
    "external-redis": "ci/external-redis-values.yaml",
    "2p2d-rdma": "ci/2p2d-rdma-values.yaml",
    "ingress": "ci/ingress-values.yaml",
}
Manifests = dict[tuple[str, str], dict[str, Any]]  # (kind, name) -> object


def values(name: str) -> dict[str, Any] | None:
    path = VALUE_SETS[name]
    return None if path is None else yaml.safe_load((CHART / path).read_text())


def render(vals: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(rendered: dict[str, str]) -> Manifests:
    out: Manifests = {}
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {name: render(values(name)) for name in VALUE_SETS}


def container(m: Manifests, component: str) -> dict[str, Any]:
    (c,) = m[("Deployment", f"{FULL}-{component}")]["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


# ---- the tools ----


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(name: str) -> None:
    report = helm.lint(str(CHART), values(name), strict=True, kube_version=f"v{KUBE}", namespace=NAMESPACE)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # warnings fail too


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_passes_kubernetes_validate_strict(
    name: str, rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    docs = [t for p, t in sorted(rendered[name].items()) if p.endswith(".yaml") and t.strip()]
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text("\n---\n".join(docs))
    r = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBE, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    passed = [ln for ln in lines if ln.startswith("INFO ") and " passed for resource " in ln]
    others = [ln for ln in lines if ln not in passed]
    # the only resource without a built-in schema may be the ServiceMonitor (checked below)
    assert all("kind ServiceMonitor with api version monitoring.coreos.com/v1" in ln for ln in others), others
    assert len(passed) + len(others) == sum(1 for _ in objects(rendered[name]))
    assert len(passed) >= 15


def test_kubernetes_validate_strict_refuses_an_unknown_field(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    deployment = yaml.safe_load(rendered["default"]["splitserve/templates/prefill-deployment.yaml"])
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    r = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBE, str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "did not validate" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
        ({"decode": {"gpus": -1}}, "/decode/gpus"),
        ({"kvBackend": "carrier-pigeon"}, "/kvBackend"),
        ({"engine": {"max_num_seq": 64}}, "/engine"),  # a typo of max_num_seqs
        ({"router": {"config": {"transfer_failure_policy": "panic"}}}, "/router/config"),
        ({"redis": {"enabled": False}}, "/redis/external"),  # external Redis without a host
        ({"ucx": {"TLS": "rc"}}, "TLS.*UCX_"),  # not a UCX_ variable
        ({"prefil": {"replicas": 2}}, "prefil"),
    ],
)
def test_schema_invalid_values_are_refused(bad: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render(bad)
    report = helm.lint(str(CHART), bad, strict=True, kube_version=f"v{KUBE}")
    assert report["errors"], f"lint accepted {bad}"


def test_a_values_file_from_the_examples_is_refused_once_broken() -> None:
    vals = values("2p2d-rdma")
    assert vals is not None
    vals["prefill"]["rdma"]["count"] = 0
    with pytest.raises(helm.HelmValuesError, match="/prefill/rdma/count"):
        render(vals)


def test_external_redis_needs_a_password_source_when_auth_is_on() -> None:
    vals = {"redis": {"enabled": False, "external": {"host": "redis.example"}}}
    with pytest.raises(helm.HelmError, match="existingSecret"):
        render(vals)
    ok = objects(render({**vals, "redis": {**vals["redis"], "auth": {"enabled": False}}}))
    assert env(container(ok, "router"))["SPLITSERVE_ROUTER_REDIS_URL"] == "redis://redis.example:6379/0"


def test_schema_settings_are_config_fields() -> None:
    """The schema's engine/router settings are real fields, so a SPLITSERVE_* the chart sets is read."""
    with helm.Chart.load(str(CHART)) as chart:
        schema = chart.schema
    assert schema is not None
    defs = schema["definitions"]
    service_fields = set(EngineConfig.model_fields) | set(ServiceConfig.model_fields)
    assert set(defs["settings"]["properties"]) <= service_fields
    assert set(defs["routerSettings"]["properties"]) <= set(RouterConfig.model_fields)
    # what the chart sets itself stays out of the user's settings
    settings = set(defs["settings"]["properties"])
    assert not {"host", "port", "redis_url", "advertise_host", "worker_id"} & settings
    # and every setting a user may want is there (model: model.path; kv_backend: kvBackend)
    missing = set(EngineConfig.model_fields) - {"model"} - settings
    assert not missing, f"add {missing} to definitions.settings in helm/splitserve/values.schema.json"
    chart_owned = {"host", "port", "redis_url", "model", "decode_urls", "prefill_urls"}
    missing = set(RouterConfig.model_fields) - chart_owned - set(defs["routerSettings"]["properties"])
    assert not missing, f"add {missing} to definitions.routerSettings in helm/splitserve/values.schema.json"


# ---- what the renders contain ----


def test_default_render(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    kinds = {k for k, _ in m}
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    }
    for role, port in (("prefill", 8101), ("decode", 8201)):
        d = m[("Deployment", f"{FULL}-{role}")]
        assert d["spec"]["replicas"] == 1
        c = container(m, role)
        assert c["args"] == [role, "--port", str(port)]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        e = env(c)
        assert e["SPLITSERVE_HOST"] == "0.0.0.0"
        # pods register their own IP and name in Redis (common/config.py ServiceConfig.advertise_host)
        assert e["SPLITSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert e["SPLITSERVE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert {"name": "http", "containerPort": port, "protocol": "TCP"} in c["ports"]
        pod = d["spec"]["template"]["spec"]
        assert not pod.get("hostIPC") and not pod.get("hostNetwork")
        assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    assert env(container(m, "decode"))["SPLITSERVE_KV_PORT"] == "8202"
    assert m[("ConfigMap", f"{FULL}-workers")]["data"]["SPLITSERVE_KV_BACKEND"] == "nixl"
    router = container(m, "router")
    assert router["args"] == ["router"] and env(router)["SPLITSERVE_ROUTER_HOST"] == "0.0.0.0"
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "nvidia.com/gpu" not in router.get("resources", {}).get("limits", {})
    assert m[("Service", f"{FULL}-router")]["spec"]["ports"][0]["port"] == 8000
    assert "NOTES.txt" in " ".join(rendered["default"])


def test_in_chart_redis_password_comes_from_a_secret(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    secret = m[("Secret", f"{FULL}-redis")]
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 32
    redis = m[("StatefulSet", f"{FULL}-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "$(REDIS_PASSWORD)" in redis["args"]
    ref = {"secretKeyRef": {"name": f"{FULL}-redis", "key": "redis-password"}}
    for role in ("router", "prefill", "decode"):
        e = env(container(m, role))
        assert e["REDIS_PASSWORD"] == ref
        url = e["SPLITSERVE_ROUTER_REDIS_URL" if role == "router" else "SPLITSERVE_REDIS_URL"]
        assert url == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
        names = [x["name"] for x in container(m, role)["env"]]
        assert names.index("REDIS_PASSWORD") < names.index(
            "SPLITSERVE_ROUTER_REDIS_URL" if role == "router" else "SPLITSERVE_REDIS_URL"
        ), "Kubernetes expands $(VAR) only from variables defined before"
    assert password not in yaml.safe_dump(m[("Deployment", f"{FULL}-prefill")])


def test_external_redis(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["external-redis"])
    assert not any(k in {"StatefulSet", "Secret"} for k, _ in m)
    assert ("NetworkPolicy", f"{FULL}-redis") not in m
    for role, var in (("router", "SPLITSERVE_ROUTER_REDIS_URL"), ("decode", "SPLITSERVE_REDIS_URL")):
        e = env(container(m, role))
        assert e["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "splitserve-redis", "key": "redis-password"}}
        assert e[var] == "rediss://:$(REDIS_PASSWORD)@redis.data.svc.cluster.local:6380/2"


def test_2p2d_with_rdma(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["2p2d-rdma"])
    for role in ("prefill", "decode"):
        d = m[("Deployment", f"{FULL}-{role}")]
        assert d["spec"]["replicas"] == 2
        pod = d["spec"]["template"]["spec"]
        c = container(m, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["resources"]["requests"] == {"cpu": "4", "memory": "32Gi"}  # the user's kept
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert pod["hostIPC"] is True
        assert not any(v["name"] == "dshm" for v in pod["volumes"])  # the node's /dev/shm instead
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert env(container(m, "prefill"))["SPLITSERVE_MAX_NUM_BATCHED_TOKENS"] == "8192"
    decode_env = env(container(m, "decode"))
    assert (decode_env["SPLITSERVE_MAX_NUM_SEQS"], decode_env["SPLITSERVE_KV_CACHE_MEMORY_MB"]) == (
        "128",
        "60000",
    )
    data = m[("ConfigMap", f"{FULL}-workers")]["data"]
    assert data["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and data["SPLITSERVE_DTYPE"] == "bfloat16"
    assert data["SPLITSERVE_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    router_data = m[("ConfigMap", f"{FULL}-router")]["data"]
    assert router_data["SPLITSERVE_ROUTER_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert router_data["SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD"] == "64"
    assert m[("Deployment", f"{FULL}-router")]["spec"]["replicas"] == 2


def test_servicemonitor_structure(rendered: dict[str, dict[str, str]]) -> None:
    assert not any(k == "ServiceMonitor" for k, _ in objects(rendered["default"]))
    m = objects(rendered["2p2d-rdma"])
    sm = m[("ServiceMonitor", FULL)]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = sm["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    (expr,) = spec["selector"]["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
    selected = [
        svc
        for (kind, _), svc in m.items()
        if kind == "Service"
        and spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        and svc["metadata"]["labels"]["app.kubernetes.io/component"] in expr["values"]
    ]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {
        "router",
        "prefill",
        "decode",
    }
    for svc in selected:
        assert any(p["name"] == "http" for p in svc["spec"]["ports"])


def test_network_policy_admits_only_the_router_from_outside(rendered: dict[str, dict[str, str]]) -> None:
    for name in VALUE_SETS:
        m = objects(rendered[name])
        release_pods = {"app.kubernetes.io/name": "splitserve", "app.kubernetes.io/instance": RELEASE}
        monitoring = values(name) is not None and (values(name) or {}).get("serviceMonitor", {}).get(
            "enabled"
        )
        for component in ("prefill", "decode", "redis"):
            np = m.get(("NetworkPolicy", f"{FULL}-{component}"))
            if np is None:
                assert component == "redis" and name == "external-redis"
                continue
            assert np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
            assert np["spec"]["policyTypes"] == ["Ingress"]
            rules = np["spec"]["ingress"]
            assert rules[0] == {"from": [{"podSelector": {"matchLabels": release_pods}}]}
            extra = rules[1:]
            if monitoring and component != "redis":
                (metrics,) = extra  # /metrics only, from the monitoring namespace
                assert metrics["ports"] == [{"port": "http", "protocol": "TCP"}]
                assert "namespaceSelector" in metrics["from"][0]
            else:
                assert extra == []
        router = m[("NetworkPolicy", f"{FULL}-router")]["spec"]["ingress"][0]
        assert router["ports"] == [{"port": "http", "protocol": "TCP"}]
        if name == "ingress":
            assert router["from"] == [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
            ]
        else:
            assert "from" not in router  # anyone may reach the router


def test_network_policy_and_pdb_can_be_turned_off() -> None:
    m = objects(render({"networkPolicy": {"enabled": False}, "podDisruptionBudget": {"enabled": False}}))
    assert not any(k in {"NetworkPolicy", "PodDisruptionBudget"} for k, _ in m)


def test_pdbs_select_each_component(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    for component in ("router", "prefill", "decode"):
        pdb = m[("PodDisruptionBudget", f"{FULL}-{component}")]
        assert pdb["spec"]["maxUnavailable"] == 1
        selector = pdb["spec"]["selector"]["matchLabels"]
        pod_labels = m[("Deployment", f"{FULL}-{component}")]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()


def test_ingress(rendered: dict[str, dict[str, str]]) -> None:
    assert not any(k == "Ingress" for k, _ in objects(rendered["default"]))
    ing = objects(rendered["ingress"])[("Ingress", FULL)]
    spec = ing["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-com-tls"}]
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": f"{FULL}-router", "port": {"name": "http"}}
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert (
        "https://llm.example.com/v1/chat/completions" in rendered["ingress"]["splitserve/templates/NOTES.txt"]
    )


def test_cpu_only_pods_request_no_gpu_and_host_network_knob() -> None:
    base = copy.deepcopy(values("default") or {})
    base.update({"prefill": {"gpus": 0}, "decode": {"gpus": 0, "hostNetwork": True}})
    m = objects(render(base))
    assert "nvidia.com/gpu" not in container(m, "prefill")["resources"].get("limits", {})
    pod = m[("Deployment", f"{FULL}-decode")]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_a_changed_port_reaches_the_command_probes_and_service() -> None:
    m = objects(render({"decode": {"port": 9201}}))
    c = container(m, "decode")
    assert c["args"] == ["decode", "--port", "9201"]
    assert {"name": "http", "containerPort": 9201, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"]["port"] == "http"
    assert m[("Service", f"{FULL}-decode")]["spec"]["ports"][0]["port"] == 9201
