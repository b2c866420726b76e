"""helm/splitserve, offline: linted strictly and rendered by Helm's own Go SDK (helm-python-sdk binds
libhelm_c, shipped in its wheel: no helm binary, no cluster, no network), every rendered manifest
checked by `kubernetes-validate --strict` against the Kubernetes 1.30 schemas shipped in its wheel,
and the renders held against what the values asked for.

ServiceMonitor (Prometheus Operator) and Certificate (cert-manager) are CRDs: kubernetes-validate ships
schemas for built-in kinds only and merely warns about others. The tests therefore accept that warning
for those two kinds alone (any other unknown kind fails) and check their structure themselves.

The security posture is checked on the renders too: every container non-root, read-only, without
capabilities; secrets only through Secret references and mounted files; NetworkPolicies evaluated
flow by flow (who may open a connection to which port of which pod)."""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import dockerfile
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
    "tls-existing-secrets": "ci/tls-existing-secrets-values.yaml",
    "tp-cpu": "ci/tp-cpu-values.yaml",
    "planner": "ci/planner-values.yaml",
}
CERT_MANAGER = {
    "tls": {"enabled": True, "certManager": {"issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}}}
}
# the CRDs kubernetes-validate has no schema for (it warns), checked by the tests below instead
CRDS = (
    "kind ServiceMonitor with api version monitoring.coreos.com/v1",
    "kind Certificate with api version cert-manager.io/v1",
)
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


def workloads(m: Manifests) -> dict[str, dict[str, Any]]:
    """component -> pod spec of every Deployment and StatefulSet."""
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]
        for (kind, _), d in m.items()
        if kind in ("Deployment", "StatefulSet")
    }


def kubernetes_validate(docs: list[str], tmp_path: Path, name: str) -> list[str]:
    """Run kubernetes-validate --strict over the documents; return its lines that are not passes."""
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
    # the only resources without a built-in schema may be the CRDs checked by the tests below
    assert all(any(crd in ln for crd in CRDS) for ln in others), others
    return passed


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
    m = objects(rendered[name])
    passed = kubernetes_validate(docs, tmp_path, name)
    assert len(passed) == sum(1 for kind, _ in m if kind not in ("ServiceMonitor", "Certificate"))
    assert len(passed) >= 15


def test_cert_manager_render_passes_kubernetes_validate_strict(tmp_path: Path) -> None:
    rendered = render(CERT_MANAGER)
    docs = [t for p, t in sorted(rendered.items()) if p.endswith(".yaml") and t.strip()]
    passed = kubernetes_validate(docs, tmp_path, "cert-manager")
    m = objects(rendered)
    assert ("Certificate", FULL) in m
    assert len(passed) == sum(1 for kind, _ in m if kind != "Certificate")


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
        ({"auth": {"requireApiKey": True, "allowUnauthenticated": True}}, "/auth"),
        (
            {"auth": {"internalSecret": {"existingSecret": "Not_A_Name"}}},
            "/auth/internalSecret/existingSecret",
        ),
        ({"tls": {"enabled": True}}, "/tls"),  # neither a Secret nor an issuer
        ({"tls": {"enabled": True, "certManager": {"issuerRef": {"kind": "ClusterIssuer"}}}}, "/tls"),
        ({"router": {"config": {"require_api_key": False}}}, "/router/config"),  # auth.* owns it
        ({"engine": {"ssl_certfile": "/x.pem"}}, "/engine"),  # tls.* owns it
        ({"redis": {"persistence": {"enabled": True, "size": "lots"}}}, "/redis/persistence/size"),
        (
            {"redis": {"persistence": {"enabled": True, "accessModes": ["ReadOnlyMany"]}}},
            "/redis/persistence",
        ),
        ({"redis": {"persistence": {"enabled": True, "existingClaim": "Not_A_Name"}}}, "/redis/persistence"),
        ({"redis": {"persistence": {"enabled": "yes"}}}, "/redis/persistence/enabled"),
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
    assert (
        not {"host", "port", "redis_url", "advertise_host", "worker_id", "ssl_certfile", "ssl_keyfile"}
        & settings
    )
    # and every setting a user may want is there (model: model.path; kv_backend: kvBackend;
    # tensor_parallel_size: <role>.tensorParallelSize, which the GPU request and KV ports follow)
    assert "tensor_parallel_size" not in settings
    missing = set(EngineConfig.model_fields) - {"model", "tensor_parallel_size"} - settings
    assert not missing, f"add {missing} to definitions.settings in helm/splitserve/values.schema.json"
    chart_owned = {"host", "port", "advertise_host", "redis_url", "model", "decode_urls", "prefill_urls"}
    # auth.* and tls.* set these (docs/security.md), never router.config
    chart_owned |= {
        "require_api_key",
        "allow_unauthenticated",
        "api_key",  # a secret: never in router.config (a ConfigMap)
        "api_keys_file",
        "ssl_certfile",
        "ssl_keyfile",
        "internal_ca_file",
        "internal_tls_check_hostname",
    }
    assert not chart_owned & set(defs["routerSettings"]["properties"])
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
        "PersistentVolumeClaim",  # the in-chart Redis' data (redis.persistence)
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
        assert e["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == "1" and "SPLITSERVE_DEVICE" not in e
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
    # one Redis user per component (deploy/redis-start.sh): the router's, the workers' and the planner's
    # passwords in the same Secret, each pod given only its own; redis-password is the admin's (the probes')
    users = {
        k: base64.b64decode(secret["data"][f"{k}-password"]).decode() for k in ("router", "worker", "planner")
    }
    assert all(len(p) == 32 for p in users.values()) and len({password, *users.values()}) == 4
    pod = m[("StatefulSet", f"{FULL}-redis")]["spec"]["template"]["spec"]
    redis = pod["containers"][0]
    assert redis["command"] == ["sh", "/scripts/redis-start.sh"] and "--requirepass" not in redis["args"]
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]  # default: REDISCLI_AUTH
    start = m[("ConfigMap", f"{FULL}-redis-start")]["data"]["redis-start.sh"]
    assert start == (ROOT / "deploy/redis-start.sh").read_text()  # compose's script, the same bytes
    (passwords,) = (v["secret"] for v in pod["volumes"] if v["name"] == "passwords")
    assert {i["path"]: i["key"] for i in passwords["items"]} == {
        "redis/password": "redis-password",
        "redis-router/password": "router-password",
        "redis-worker/password": "worker-password",
        "redis-planner/password": "planner-password",
    }
    for role in ("router", "prefill", "decode"):
        user = "router" if role == "router" else "worker"
        e = env(container(m, role))
        assert e["REDIS_PASSWORD"] == {"secretKeyRef": {"name": f"{FULL}-redis", "key": f"{user}-password"}}
        url = e["SPLITSERVE_ROUTER_REDIS_URL" if role == "router" else "SPLITSERVE_REDIS_URL"]
        assert url == f"redis://{user}:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
        names = [x["name"] for x in container(m, role)["env"]]
        assert names.index("REDIS_PASSWORD") < names.index(
            "SPLITSERVE_ROUTER_REDIS_URL" if role == "router" else "SPLITSERVE_REDIS_URL"
        ), "Kubernetes expands $(VAR) only from variables defined before"
    assert password not in yaml.safe_dump(m[("Deployment", f"{FULL}-prefill")])
    # without the users (redis.auth.acl=false): one password, --requirepass, as before
    plain = objects(render({"redis": {"auth": {"acl": False}}}))
    redis = plain[("StatefulSet", f"{FULL}-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "$(REDIS_PASSWORD)" in redis["args"] and "command" not in redis
    url = env(container(plain, "router"))["SPLITSERVE_ROUTER_REDIS_URL"]
    assert url == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
    assert "router-password" not in plain[("Secret", f"{FULL}-redis")]["data"]


def redis_opts(m: Manifests) -> dict[str, str]:
    (redis,) = workloads(m)["redis"]["containers"]
    args = redis["args"]
    return dict(zip(args[::2], args[1::2], strict=True))


def redis_data_volume(m: Manifests) -> dict[str, Any]:
    pod = workloads(m)["redis"]
    (redis,) = pod["containers"]
    (mount,) = (vm for vm in redis["volumeMounts"] if vm["mountPath"] == "/data")
    assert not mount.get("readOnly")
    (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume


def test_in_chart_redis_persists_api_keys(rendered: dict[str, dict[str, str]], tmp_path: Path) -> None:
    """By default the in-chart Redis keeps its data (the API keys: docs/redis.md) across restarts: an
    append-only file fsynced every second in /data, a PVC the chart makes and keeps on uninstall. What
    these settings do is tested against a real server in tests/integration/test_redis_persistence.py."""
    m = objects(rendered["default"])
    opts = redis_opts(m)
    assert (opts["--dir"], opts["--appendonly"], opts["--appendfsync"]) == ("/data", "yes", "everysec")
    assert opts["--save"] == ""  # the append-only file alone: no snapshot forks
    assert redis_data_volume(m) == {
        "name": "data",
        "persistentVolumeClaim": {"claimName": f"{FULL}-redis-data"},
    }
    pvc = m[("PersistentVolumeClaim", f"{FULL}-redis-data")]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # `helm uninstall` keeps keys
    assert pvc["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in pvc["spec"]  # the cluster's default StorageClass
    sts = m[("StatefulSet", f"{FULL}-redis")]["spec"]
    assert sts["replicas"] == 1 and "volumeClaimTemplates" not in sts  # upgrades need no StatefulSet deletion
    # the redis image's user owns the volume (fsGroup), and only it runs there
    assert workloads(m)["redis"]["securityContext"]["fsGroup"] == 999

    # size and class; "-" is the explicit empty class (no dynamic provisioning)
    custom = {"redis": {"persistence": {"enabled": True, "size": "5Gi", "storageClass": "fast-ssd"}}}
    pvc = objects(render(custom))[("PersistentVolumeClaim", f"{FULL}-redis-data")]
    assert (pvc["spec"]["storageClassName"], pvc["spec"]["resources"]["requests"]["storage"]) == (
        "fast-ssd",
        "5Gi",
    )
    no_class = render({"redis": {"persistence": {"enabled": True, "storageClass": "-"}}})
    assert (
        objects(no_class)[("PersistentVolumeClaim", f"{FULL}-redis-data")]["spec"]["storageClassName"] == ""
    )
    # a claim of one's own: mounted, none made
    own_claim = render({"redis": {"persistence": {"enabled": True, "existingClaim": "redis-keys"}}})
    mine = objects(own_claim)
    assert redis_data_volume(mine)["persistentVolumeClaim"] == {"claimName": "redis-keys"}
    assert not [name for kind, name in mine if kind == "PersistentVolumeClaim"]
    assert redis_opts(mine)["--appendonly"] == "yes"
    # off: as before, nothing kept (an emptyDir, no append-only file), no PVC
    off = objects(render({"redis": {"persistence": {"enabled": False}}}))
    assert redis_data_volume(off) == {"name": "data", "emptyDir": {}}
    assert redis_opts(off)["--appendonly"] == "no" and "--appendfsync" not in redis_opts(off)
    assert not [name for kind, name in off if kind == "PersistentVolumeClaim"]
    # an external Redis persists (or not) on its own: the chart makes no PVC for it
    assert not [n for k, n in objects(rendered["external-redis"]) if k == "PersistentVolumeClaim"]
    # the variants pass kubernetes-validate --strict as well (the default render: the test above)
    for name, r in (("redis-no-class", no_class), ("redis-existing-claim", own_claim)):
        assert len(kubernetes_validate([r["splitserve/templates/redis.yaml"]], tmp_path, name)) >= 3, name


def test_external_redis(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["external-redis"])
    assert not any(k == "StatefulSet" for k, _ in m)
    assert [name for k, name in m if k == "Secret"] == [f"{FULL}-internal"]  # no Redis password Secret
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
    assert json.loads(data["SPLITSERVE_TENANT_WEIGHTS"]) == {"acme": 3, "free": 1}  # a map goes as JSON
    assert data["SPLITSERVE_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    router_data = m[("ConfigMap", f"{FULL}-router")]["data"]
    assert router_data["SPLITSERVE_ROUTER_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert router_data["SPLITSERVE_ROUTER_LOCAL_PREFILL_THRESHOLD"] == "64"
    assert m[("Deployment", f"{FULL}-router")]["spec"]["replicas"] == 2


def servicemonitors(m: Manifests) -> dict[str, dict[str, Any]]:
    """component -> the ServiceMonitor endpoint that scrapes its Services (each selected exactly once)."""
    out: dict[str, dict[str, Any]] = {}
    for (kind, _), sm in m.items():
        if kind != "ServiceMonitor":
            continue
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        spec = sm["spec"]
        assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = spec["endpoints"]
        (expr,) = spec["selector"]["matchExpressions"]
        assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
        for (k, _), svc in m.items():
            labels = svc["metadata"]["labels"]
            if (
                k == "Service"
                and spec["selector"]["matchLabels"].items() <= labels.items()
                and labels["app.kubernetes.io/component"] in expr["values"]
            ):
                assert any(p["name"] == endpoint["port"] for p in svc["spec"]["ports"])
                assert labels["app.kubernetes.io/component"] not in out
                out[labels["app.kubernetes.io/component"]] = endpoint
    return out


def test_servicemonitor_structure(rendered: dict[str, dict[str, str]]) -> None:
    assert not any(k == "ServiceMonitor" for k, _ in objects(rendered["default"]))
    m = objects(rendered["2p2d-rdma"])
    for name in (f"{FULL}-router", f"{FULL}-workers"):
        assert m[("ServiceMonitor", name)]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = servicemonitors(m)
    assert set(endpoints) == {"router", "prefill", "decode"}
    plain = {"port": "http", "path": "/metrics", "interval": "15s"}
    assert endpoints["prefill"] == endpoints["decode"] == plain
    # the router's /metrics wants an API key with the metrics scope: a bearer token, to the router only
    assert endpoints["router"] == {
        **plain,
        "authorization": {
            "type": "Bearer",
            "credentials": {"name": "splitserve-metrics-key", "key": "api-key"},
        },
    }


def test_servicemonitor_scrapes_https_against_the_release_ca() -> None:
    vals = {
        **(values("2p2d-rdma") or {}),
        "tls": {"enabled": True, "secretName": "splitserve-tls", "router": False},
    }
    endpoints = servicemonitors(objects(render(vals)))
    assert "scheme" not in endpoints["router"]  # tls.router=false: its own port stays plain
    for role in ("prefill", "decode"):
        assert endpoints[role]["scheme"] == "https"
        assert endpoints[role]["tlsConfig"] == {
            "ca": {"secret": {"name": "splitserve-tls", "key": "ca.crt"}},
            "serverName": f"{FULL}-router.{NAMESPACE}.svc",  # one certificate for all: a name it has
        }
        assert "authorization" not in endpoints[role]


# ---- security posture ----


@pytest.fixture(scope="module")
def all_renders(rendered: dict[str, dict[str, str]]) -> dict[str, Manifests]:
    """Every value set, plus TLS from a cert-manager issuer and the tcp KV backend."""
    out = {name: objects(r) for name, r in rendered.items()}
    out["cert-manager"] = objects(render(CERT_MANAGER))
    out["tcp"] = objects(render({"kvBackend": "tcp"}))
    return out


def test_every_container_runs_non_root_read_only_without_capabilities(
    all_renders: dict[str, Manifests],
) -> None:
    user = [c.value[0] for c in dockerfile.parse_file(str(ROOT / "Dockerfile")) if c.cmd == "USER"]
    assert user[-1] == "10001:10001", "the chart's runAsUser/runAsGroup are the image's user"
    for name, m in all_renders.items():
        pods = workloads(m)
        assert {"router", "prefill", "decode"} <= set(pods), name
        for component, pod in pods.items():
            where = f"{name}/{component}"
            uid = 999 if component == "redis" else 10001  # the redis image's own user
            psc = pod["securityContext"]
            assert psc["runAsNonRoot"] is True, where
            assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (uid, uid, uid), where
            assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert pod["automountServiceAccountToken"] is False, where
            volumes = {v["name"]: v for v in pod["volumes"]}
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, where
                assert sc["allowPrivilegeEscalation"] is False, where
                assert sc["capabilities"]["drop"] == ["ALL"], where
                rdma = any(r.startswith("rdma/") for r in c.get("resources", {}).get("limits", {}))
                assert set(sc["capabilities"].get("add", [])) <= ({"IPC_LOCK"} if rdma else set()), where
                assert not sc.get("privileged") and sc.get("runAsUser", uid) == uid, where
                # the writable places are volumes: /tmp and /dev/shm emptyDirs (Redis: its /data, a PVC
                # with redis.persistence, else an emptyDir)
                mounts = {vm["mountPath"]: vm for vm in c["volumeMounts"]}
                writable = {"/data", "/tmp"} if component == "redis" else {"/tmp", "/dev/shm"}
                for path, vm in mounts.items():
                    if path in writable:
                        kinds = (
                            {"emptyDir", "persistentVolumeClaim"} if component == "redis" else {"emptyDir"}
                        )
                        assert kinds & set(volumes[vm["name"]]), where
                    else:
                        assert vm.get("readOnly") is True, f"{where}: {path}"
                if component != "redis":
                    assert volumes[mounts["/tmp"]["name"]]["emptyDir"] == {}, where
                if component in ("prefill", "decode") and not pod.get("hostIPC"):
                    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory", where


def secret_file(m: Manifests, component: str, path: str) -> tuple[str, str]:
    """(Secret name, key) behind a file path of a component's container, through its mounts."""
    pod = workloads(m)[component]
    (c,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    directory, _, filename = path.rpartition("/")
    (vm,) = (vm for vm in c["volumeMounts"] if vm["mountPath"] == directory)
    assert vm["readOnly"] is True
    secret = volumes[vm["name"]]["secret"]
    assert secret["defaultMode"] == 0o440  # the pod's group (fsGroup) reads, nobody else
    items = {i["path"]: i["key"] for i in secret.get("items", [])}
    if items:
        return secret["secretName"], items[filename]
    return secret["secretName"], filename


def secret_values(m: Manifests) -> set[str]:
    out = set()
    for (kind, _), obj in m.items():
        if kind == "Secret":
            out |= {base64.b64decode(v).decode() for v in obj.get("data", {}).values()}
            out |= set(obj.get("stringData", {}).values())
    return out


def test_internal_secret_is_generated_once_and_mounted_as_a_file(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    secret = m[("Secret", f"{FULL}-internal")]
    value = base64.b64decode(secret["data"]["internal-secret"]).decode()
    assert len(value) == 48 and value.isalnum()
    # `helm template` has no cluster to look the old value up in: a new one each render (documented);
    # install/upgrade keep the live one through lookup
    again = objects(render(None))[("Secret", f"{FULL}-internal")]["data"]["internal-secret"]
    assert again != secret["data"]["internal-secret"]
    template = (CHART / "templates/internal-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    for role in ("router", "prefill", "decode"):
        e = env(container(m, role))
        assert "SPLITSERVE_INTERNAL_SECRET" not in e and "SPLITSERVE_INTERNAL_SECRET_ACCEPT_FILE" not in e
        assert secret_file(m, role, e["SPLITSERVE_INTERNAL_SECRET_FILE"]) == (
            f"{FULL}-internal",
            "internal-secret",
        )
    assert "SPLITSERVE_INTERNAL_SECRET_FILE" not in env(workloads(m)["redis"]["containers"][0])


def test_existing_secrets_are_mounted_and_nothing_is_generated(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["tls-existing-secrets"])
    assert not any(kind == "Secret" for kind, _ in m)
    for role in ("router", "prefill", "decode"):
        e = env(container(m, role))
        assert secret_file(m, role, e["SPLITSERVE_INTERNAL_SECRET_FILE"]) == (
            "splitserve-internal",
            "internal-secret",
        )
        assert secret_file(m, role, e["SPLITSERVE_INTERNAL_SECRET_ACCEPT_FILE"]) == (
            "splitserve-internal-previous",
            "internal-secret",
        )
        assert e["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "splitserve-redis", "key": "redis-password"}}
        if role != "router":
            assert "SPLITSERVE_ROUTER_API_KEYS_FILE" not in e
            assert not any(v["name"] == "api-keys" for v in workloads(m)[role]["volumes"])
    e = env(container(m, "router"))
    assert secret_file(m, "router", e["SPLITSERVE_ROUTER_API_KEYS_FILE"]) == (
        "splitserve-api-keys",
        "api-keys",
    )


def test_no_secret_value_in_plain_env_or_config(all_renders: dict[str, Manifests]) -> None:
    sensitive = re.compile(r"SECRET|PASSWORD|_TOKEN$|API_KEY|_AUTH$")
    for name, m in all_renders.items():
        values_ = secret_values(m)
        assert values_ or name == "tls-existing-secrets", name  # the chart's own Secrets were rendered
        for component, pod in workloads(m).items():
            for c in pod["containers"]:
                for e in c.get("env", []):
                    where = f"{name}/{component}: {e['name']}"
                    if "value" in e:
                        assert not any(v in e["value"] for v in values_), where
                        assert (
                            not sensitive.search(e["name"])
                            or e["name"].endswith("_FILE")
                            or e["name"] == "SPLITSERVE_ROUTER_REQUIRE_API_KEY"
                        ), where
                        if "REDIS_URL" in e["name"] and "@" in e["value"]:
                            assert ":$(REDIS_PASSWORD)@" in e["value"], where  # expanded by the kubelet
                    elif sensitive.search(e["name"]):
                        assert set(e["valueFrom"]) == {"secretKeyRef"}, where
                # the args see the password only through $(REDIS_PASSWORD) too
                assert not any(v in " ".join(c.get("args", [])) for v in values_), f"{name}/{component}"
        for (kind, _), obj in m.items():
            if kind == "ConfigMap":
                assert not any(v in yaml.safe_dump(obj["data"]) for v in values_), name
                assert not any(sensitive.search(k) for k in obj["data"]), name


def test_api_keys_are_required_by_default(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    e = env(container(m, "router"))
    assert e["SPLITSERVE_ROUTER_REQUIRE_API_KEY"] == "true"
    assert "SPLITSERVE_ROUTER_ALLOW_UNAUTHENTICATED" not in e and "SPLITSERVE_ROUTER_API_KEYS_FILE" not in e
    for role in ("prefill", "decode"):
        assert not any(k.startswith("SPLITSERVE_ROUTER_") for k in env(container(m, role)))
    notes = rendered["default"]["splitserve/templates/NOTES.txt"]
    # the command reads the router's Redis URL from the pod's environment (SPLITSERVE_ROUTER_REDIS_URL)
    assert f"kubectl -n {NAMESPACE} exec deploy/{FULL}-router -- splitserve keys create --name me" in notes
    assert "docs/security.md" in notes and "authorization: Bearer" in notes


def test_unauthenticated_router_is_an_explicit_opt_out() -> None:
    r = render({"auth": {"requireApiKey": False, "allowUnauthenticated": True}})
    e = env(container(objects(r), "router"))
    assert (e["SPLITSERVE_ROUTER_REQUIRE_API_KEY"], e["SPLITSERVE_ROUTER_ALLOW_UNAUTHENTICATED"]) == (
        "false",
        "true",
    )
    assert "WARNING: auth.allowUnauthenticated is on" in r["splitserve/templates/NOTES.txt"]


def probe_schemes(c: dict[str, Any]) -> set[str]:
    return {
        c[p]["httpGet"].get("scheme", "HTTP") for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }


def test_tls_certificates_are_mounted_and_wired(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["tls-existing-secrets"])
    for role in ("prefill", "decode"):
        e = env(container(m, role))
        assert secret_file(m, role, e["SPLITSERVE_SSL_CERTFILE"]) == ("splitserve-tls", "tls.crt")
        assert secret_file(m, role, e["SPLITSERVE_SSL_KEYFILE"]) == ("splitserve-tls", "tls.key")
        assert probe_schemes(container(m, role)) == {"HTTPS"}
    e = env(container(m, "router"))
    assert secret_file(m, "router", e["SPLITSERVE_ROUTER_SSL_CERTFILE"]) == ("splitserve-tls", "tls.crt")
    assert secret_file(m, "router", e["SPLITSERVE_ROUTER_SSL_KEYFILE"]) == ("splitserve-tls", "tls.key")
    assert secret_file(m, "router", e["SPLITSERVE_ROUTER_INTERNAL_CA_FILE"]) == ("splitserve-tls", "ca.crt")
    assert probe_schemes(container(m, "router")) == {"HTTPS"}
    # Redis: the TLS port only, the same certificate; clients verify it against ca.crt (redis-py reads
    # ssl_ca_certs from the URL)
    redis_pod = workloads(m)["redis"]
    (redis,) = redis_pod["containers"]
    args = redis["args"]
    opts = dict(zip(args[::2], args[1::2], strict=True))
    assert (opts["--port"], opts["--tls-port"], opts["--tls-auth-clients"]) == ("0", "6379", "no")
    tls_volume = next(v for v in redis_pod["volumes"] if v["name"] == "tls")["secret"]
    assert tls_volume["secretName"] == "splitserve-tls"
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
        assert opts[flag].startswith(
            next(vm["mountPath"] for vm in redis["volumeMounts"] if vm["name"] == "tls")
        )
    assert "--tls" in redis["readinessProbe"]["exec"]["command"]
    for role, var in (("router", "SPLITSERVE_ROUTER_REDIS_URL"), ("prefill", "SPLITSERVE_REDIS_URL")):
        url = env(container(m, role))[var]
        head, _, ca = url.partition("?ssl_ca_certs=")
        assert head == f"rediss://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
        assert secret_file(m, role, ca) == ("splitserve-tls", "ca.crt")


def test_tls_off_by_default_and_per_part(rendered: dict[str, dict[str, str]]) -> None:
    m = objects(rendered["default"])
    for role in ("router", "prefill", "decode"):
        c = container(m, role)
        assert not [k for k in env(c) if "SSL" in k or "CA_FILE" in k]
        assert probe_schemes(c) == {"HTTP"}
        assert not any(v["name"] == "tls" for v in workloads(m)[role]["volumes"])
    # the router's own port plain (an Ingress terminates TLS) and the in-chart Redis plain
    m = objects(
        render({"tls": {"enabled": True, "secretName": "splitserve-tls", "router": False, "redis": False}})
    )
    e = env(container(m, "router"))
    assert "SPLITSERVE_ROUTER_SSL_CERTFILE" not in e and probe_schemes(container(m, "router")) == {"HTTP"}
    assert secret_file(m, "router", e["SPLITSERVE_ROUTER_INTERNAL_CA_FILE"]) == ("splitserve-tls", "ca.crt")
    tls_volume = next(v for v in workloads(m)["router"]["volumes"] if v["name"] == "tls")["secret"]
    assert tls_volume["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # not the key it does not use
    assert probe_schemes(container(m, "decode")) == {"HTTPS"}
    assert e["SPLITSERVE_ROUTER_REDIS_URL"] == f"redis://router:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
    assert "--tls-port" not in workloads(m)["redis"]["containers"][0]["args"]
    with pytest.raises(helm.HelmValuesError, match="/tls"):
        render({"tls": {"enabled": True}})


def test_cert_manager_certificate_names_every_service() -> None:
    m = objects(render(CERT_MANAGER))
    cert = m[("Certificate", FULL)]
    assert cert["apiVersion"] == "cert-manager.io/v1"
    spec = cert["spec"]
    assert set(spec) == {
        "secretName",
        "issuerRef",
        "duration",
        "renewBefore",
        "privateKey",
        "usages",
        "dnsNames",
    }
    assert spec["secretName"] == f"{FULL}-tls"
    assert spec["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    names = set(spec["dnsNames"])
    assert len(names) == len(spec["dnsNames"])
    for svc in ("router", "redis", "prefill", "decode"):
        assert {
            f"{FULL}-{svc}",
            f"{FULL}-{svc}.{NAMESPACE}.svc",
            f"{FULL}-{svc}.{NAMESPACE}.svc.cluster.local",
        } <= names
    assert {f"*.{FULL}-prefill.{NAMESPACE}.svc", f"*.{FULL}-decode.{NAMESPACE}.svc"} <= names
    # what the clients connect to by name is in it: the Redis URL's host
    url = env(container(m, "router"))["SPLITSERVE_ROUTER_REDIS_URL"]
    assert url.split("@")[1].split(":")[0] in names
    for role in ("router", "prefill", "decode", "redis"):
        tls = next(v for v in workloads(m)[role]["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == f"{FULL}-tls"
    assert not any(
        k == "Certificate" for k, _ in objects(render({"tls": {"enabled": True, "secretName": "x"}}))
    )


# ---- NetworkPolicy, flow by flow ----

OTHER_NS = {"kubernetes.io/metadata.name": "elsewhere"}
SOURCES: dict[str, tuple[dict[str, str], dict[str, str]]] = {  # name -> (namespace labels, pod labels)
    "client-elsewhere": (OTHER_NS, {"app": "client"}),
    "neighbour-pod": ({"kubernetes.io/metadata.name": NAMESPACE}, {"app": "neighbour"}),
    "ingress-controller": ({"kubernetes.io/metadata.name": "ingress-nginx"}, {"app": "ingress-nginx"}),
    "prometheus": ({"kubernetes.io/metadata.name": "monitoring"}, {"app": "prometheus"}),
    "other-release-router": (
        {"kubernetes.io/metadata.name": NAMESPACE},
        {
            "app.kubernetes.io/name": "splitserve",
            "app.kubernetes.io/instance": "other",
            "app.kubernetes.io/component": "router",
        },
    ),
}
OTHER_PORT = 40000  # a port nothing declares: where UCX, gloo and NCCL listen


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        have = labels.get(e["key"])
        ok = {
            "In": have in e.get("values", []),
            "NotIn": have not in e.get("values", []),
            "Exists": have is not None,
            "DoesNotExist": have is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def admits(peer: dict[str, Any], ns_labels: dict[str, str], pod_labels: dict[str, str]) -> bool:
    assert "ipBlock" not in peer  # not modelled here
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], ns_labels)
    else:
        ns_ok = ns_labels.get("kubernetes.io/metadata.name") == NAMESPACE
    return ns_ok and ("podSelector" not in peer or selects(peer["podSelector"], pod_labels))


def allowed(m: Manifests, source: str, component: str, port: int) -> bool:
    """Whether NetworkPolicy admits a TCP connection from `source` to `component`'s pods on `port`."""
    pods = workloads(m)
    ns_labels, src_labels = SOURCES.get(source) or (
        {"kubernetes.io/metadata.name": NAMESPACE},
        _pod_labels(m, source),
    )
    dst = _pod_labels(m, component)
    named = {p["name"]: p["containerPort"] for c in pods[component]["containers"] for p in c.get("ports", [])}
    policies = [
        np["spec"]
        for (kind, _), np in m.items()
        if kind == "NetworkPolicy"
        and "Ingress" in np["spec"]["policyTypes"]
        and selects(np["spec"]["podSelector"], dst)
    ]
    if not policies:
        return True  # not isolated
    for spec in policies:
        for rule in spec.get("ingress", []):
            peers = rule.get("from") or []
            ports = rule.get("ports") or []
            if peers and not any(admits(p, ns_labels, src_labels) for p in peers):
                continue
            if ports and not any(
                p.get("protocol", "TCP") == "TCP"
                and ("port" not in p or named.get(p["port"], p["port"]) == port)
                for p in ports
            ):
                continue
            return True
    return False


def _pod_labels(m: Manifests, component: str) -> dict[str, str]:
    for (kind, _), d in m.items():
        if kind in ("Deployment", "StatefulSet"):
            labels: dict[str, str] = d["spec"]["template"]["metadata"]["labels"]
            if labels["app.kubernetes.io/component"] == component:
                return labels
    raise KeyError(component)


def flows(m: Manifests) -> set[tuple[str, str, str]]:
    """Every admitted (source, destination component, port name) over the candidates."""
    pods = workloads(m)
    ports = {
        component: {
            **{p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])},
            "other": OTHER_PORT,
        }
        for component, pod in pods.items()
    }
    out = set()
    for source in [*SOURCES, *pods]:
        for component, named in ports.items():
            for port_name, port in named.items():
                if source != component and allowed(m, source, component, port):
                    out.add((source, component, port_name))
    return out


def expected_flows(
    m: Manifests, router_from: str | None, monitoring: bool, kv_any_port: bool
) -> set[tuple[str, str, str]]:
    pods = workloads(m)
    everyone = [*SOURCES, *pods]
    # the decode pods' KV receivers: kv, and kv-1 .. with tensor parallelism (kvPort + rank)
    kv_ports = [p["name"] for c in pods["decode"]["containers"] for p in c["ports"] if p["name"] != "http"]
    out = {(s, "router", "http") for s in everyone if router_from is None or s == router_from}
    out |= {("router", "prefill", "http"), ("router", "decode", "http")}
    out |= {("prefill", "decode", p) for p in kv_ports}
    if "redis" in pods:
        out |= {(s, "redis", "redis") for s in ("router", "prefill", "decode", "planner") if s in pods}
    if "planner" in pods:  # its signals: the router's /metrics, whoever else may reach the router
        out.add(("planner", "router", "http"))
    if monitoring:
        out |= {("prometheus", c, "http") for c in ("router", "prefill", "decode")}
    if kv_any_port:  # the data plane: either side, any port
        out |= {("prefill", "decode", p) for p in ("http", *kv_ports, "other")}
        out |= {("decode", "prefill", p) for p in ("http", "other")}
    return {f for f in out if f[0] != f[1]}


@pytest.mark.parametrize(
    "name, router_from, monitoring, kv_any_port",
    [
        ("default", None, False, True),
        ("external-redis", None, False, True),
        ("2p2d-rdma", None, True, True),
        ("ingress", "ingress-controller", False, True),
        ("tls-existing-secrets", None, False, True),
        ("tp-cpu", None, False, False),
        ("cert-manager", None, False, True),
        ("tcp", None, False, False),
        ("planner", "ingress-controller", False, True),
    ],
)
def test_network_policies_admit_exactly_the_needed_flows(
    all_renders: dict[str, Manifests], name: str, router_from: str | None, monitoring: bool, kv_any_port: bool
) -> None:
    m = all_renders[name]
    got = flows(m)
    want = expected_flows(m, router_from, monitoring, kv_any_port)
    assert got == want, (
        f"admitted but not wanted: {sorted(got - want)}; wanted but refused: {sorted(want - got)}"
    )
    # every pod of the release is isolated by the default-deny policy, whatever else selects it
    deny = m[("NetworkPolicy", f"{FULL}-default-deny")]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    for component in workloads(m):
        assert selects(deny["podSelector"], _pod_labels(m, component))
    assert ("NetworkPolicy", f"{FULL}-redis") in m or name == "external-redis"


def test_decode_kv_port_is_fixed_named_and_only_for_prefill(all_renders: dict[str, Manifests]) -> None:
    m = all_renders["tcp"]
    c = container(m, "decode")
    assert {"name": "kv", "containerPort": 8202, "protocol": "TCP"} in c["ports"]
    assert env(c)["SPLITSERVE_KV_PORT"] == "8202"
    admitted = {s for s in [*SOURCES, "router", "prefill", "redis"] if allowed(m, s, "decode", 8202)}
    assert admitted == {"prefill"}


def test_metrics_scrapes_reach_the_router_behind_router_from() -> None:
    vals = {**(values("ingress") or {}), "serviceMonitor": {"enabled": True}}
    m = objects(render(vals))
    assert flows(m) == expected_flows(m, "ingress-controller", True, True)


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


# ---- tensor parallelism ----

TP_ON_CPU = "tensor parallelism runs on CPU pods only for now: set gpus: 0"


def test_tensor_parallel_prefill_2_decode_1_on_cpu_pods(rendered: dict[str, dict[str, str]]) -> None:
    """ci/tp-cpu-values.yaml (linted, kubernetes-validated and flow-checked with the other value sets)."""
    m = objects(rendered["tp-cpu"])
    prefill, decode = container(m, "prefill"), container(m, "decode")
    assert env(prefill)["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert env(prefill)["SPLITSERVE_DEVICE"] == "cpu"  # pinned: a GPU the runtime exposes anyway is not used
    assert env(decode)["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == "1" and "SPLITSERVE_DEVICE" not in env(decode)
    assert env(prefill)["SPLITSERVE_NUM_THREADS"] == "4"
    for role in ("prefill", "decode"):
        assert "nvidia.com/gpu" not in container(m, role)["resources"].get("limits", {}), role
    assert m[("Deployment", f"{FULL}-decode")]["spec"]["replicas"] == 2
    assert [p["name"] for p in prefill["ports"]] == ["http"]
    assert [(p["name"], p["containerPort"]) for p in decode["ports"]] == [("http", 8201), ("kv", 8202)]
    assert m[("ConfigMap", f"{FULL}-workers")]["data"]["SPLITSERVE_KV_BACKEND"] == "tcp"


DECODE_TP = {"kvBackend": "tcp", "prefill": {"gpus": 0}, "decode": {"gpus": 0, "tensorParallelSize": 2}}


def test_decode_tensor_parallel_opens_a_kv_port_per_rank(tmp_path: Path) -> None:
    rendered = render(DECODE_TP)
    docs = [t for p, t in sorted(rendered.items()) if p.endswith(".yaml") and t.strip()]
    m = objects(rendered)
    assert len(kubernetes_validate(docs, tmp_path, "decode-tp")) == len(m)
    report = helm.lint(str(CHART), DECODE_TP, strict=True, kube_version=f"v{KUBE}", namespace=NAMESPACE)
    assert report["errors"] == [] and not [x for x in report["messages"] if x["severity"] >= 2], report
    c = container(m, "decode")
    # rank r listens on kvPort + r (SPLITSERVE_KV_PORT is rank 0's; the service derives the others)
    ports = [(p["name"], p["containerPort"]) for p in c["ports"]]
    assert ports == [("http", 8201), ("kv", 8202), ("kv-1", 8203)]
    e = env(c)
    assert (e["SPLITSERVE_TENSOR_PARALLEL_SIZE"], e["SPLITSERVE_KV_PORT"]) == ("2", "8202")
    for port in (8202, 8203):
        admitted = {s for s in [*SOURCES, "router", "prefill", "redis"] if allowed(m, s, "decode", port)}
        assert admitted == {"prefill"}, port
    assert flows(m) == expected_flows(m, None, False, False)
    # the headless Service is for DNS and scraping: KV endpoints are pod IPs from the registry
    assert [p["name"] for p in m[("Service", f"{FULL}-decode")]["spec"]["ports"]] == ["http"]
    # any data-plane backend: the ranks' ports are among the prefill pods' any-port flows too
    m = objects(render({**DECODE_TP, "kvBackend": "nixl"}))
    assert flows(m) == expected_flows(m, None, False, True)
    # a moved kvPort moves the whole range
    m = objects(render({**DECODE_TP, "decode": {"gpus": 0, "tensorParallelSize": 4, "kvPort": 9000}}))
    ports = [(p["name"], p["containerPort"]) for p in container(m, "decode")["ports"]]
    assert ports == [("http", 8201), ("kv", 9000), ("kv-1", 9001), ("kv-2", 9002), ("kv-3", 9003)]
    assert flows(m) == expected_flows(m, None, False, False)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_tensor_parallel_with_gpus_is_refused(role: str) -> None:
    bad = {role: {"gpus": 1, "tensorParallelSize": 2}}
    message = f"{role}.tensorParallelSize is 2 with {role}.gpus 1: {TP_ON_CPU}"
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(bad)
    # (a template `fail`, not the schema, so that install and template print this message; Helm's
    # lint only logs a `fail`)
    # an explicit CUDA device is refused the same way
    message = f"{role}.tensorParallelSize is 2 with engine device cuda: {TP_ON_CPU}"
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render({"engine": {"device": "cuda"}, role: {"gpus": 0, "tensorParallelSize": 2}})


def test_gpus_are_per_rank_and_tensor_parallel_values_are_checked() -> None:
    # gpus counts per rank: at TP 1 the pod's request is gpus itself (GPU TP: gpus x tensorParallelSize)
    m = objects(render({"prefill": {"gpus": 2, "tensorParallelSize": 1}}))
    assert container(m, "prefill")["resources"]["limits"]["nvidia.com/gpu"] == 2
    # a per-role device wins over the CPU pin (and is not set twice)
    m = objects(render({"prefill": {"gpus": 0, "tensorParallelSize": 2, "engine": {"device": "cpu"}}}))
    names = [x["name"] for x in container(m, "prefill")["env"]]
    assert names.count("SPLITSERVE_DEVICE") == 1
    with pytest.raises(helm.HelmValuesError, match="/decode/tensorParallelSize"):
        render({"decode": {"tensorParallelSize": 0}})
    with pytest.raises(helm.HelmValuesError, match="/prefill/tensorParallelSize"):
        render({"prefill": {"tensorParallelSize": "2"}})
    with pytest.raises(helm.HelmValuesError, match="tensor_parallel_size"):  # the chart owns it
        render({"prefill": {"engine": {"tensor_parallel_size": 2}}})
    with pytest.raises(helm.HelmRenderError, match="decode.port 8203 falls in the KV ports 8202-8203"):
        render({**DECODE_TP, "decode": {"gpus": 0, "tensorParallelSize": 2, "port": 8203}})
    with pytest.raises(helm.HelmRenderError, match="past 65535"):
        render({**DECODE_TP, "decode": {"gpus": 0, "tensorParallelSize": 2, "kvPort": 65535}})


def test_the_router_runs_its_own_image_and_the_workers_the_engines(
    rendered: dict[str, dict[str, str]],
) -> None:
    """The router's image is the Dockerfile's router target (no torch); prefill and decode the engine's."""
    m = objects(rendered["default"])
    assert container(m, "router")["image"] == "splitserve:router"
    for role in ("prefill", "decode"):
        assert container(m, role)["image"] == "splitserve:cuda", role
    one = objects(render({"router": {"image": {"repository": "reg/splitserve", "tag": "cuda"}}}))
    assert container(one, "router")["image"] == "reg/splitserve:cuda"


# ---- the planner (planner.enabled) ----

PLANNER_RULES = [
    {"apiGroups": ["apps"], "resources": ["deployments/scale"],
     "resourceNames": [f"{FULL}-prefill", f"{FULL}-decode"], "verbs": ["get", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "resourceNames": [f"{FULL}-prefill", f"{FULL}-decode"], "verbs": ["get"]},
]  # fmt: skip


def test_the_planner_is_off_by_default(rendered: dict[str, dict[str, str]]) -> None:
    for name, r in rendered.items():
        m = objects(r)
        planner = {key for key in m if key[1] == f"{FULL}-planner"}
        assert bool(planner) == (name == "planner"), name
        assert (
            not {k for k, _ in m} & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
            or name == "planner"
        )


def test_the_planner_runs_with_exactly_the_rbac_it_needs(rendered: dict[str, dict[str, str]]) -> None:
    """ci/planner-values.yaml (linted, kubernetes-validated, flow-checked and security-checked with the
    other value sets): the Role allows get/patch on the two Deployments' scale and get on them, nothing
    else; the planner's own ServiceAccount gets it; the token is a projected, read-only one."""
    m = objects(rendered["planner"])
    name = f"{FULL}-planner"
    assert {k for k in m if k[1] == name} == {
        ("ServiceAccount", name),
        ("Role", name),
        ("RoleBinding", name),
        ("Deployment", name),
    }
    assert m[("Role", name)]["rules"] == PLANNER_RULES
    binding = m[("RoleBinding", name)]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    pod = m[("Deployment", name)]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is False
    for component in ("router", "prefill", "decode"):  # the others keep the shared, tokenless account
        assert workloads(m)[component]["serviceAccountName"] == FULL
    (c,) = pod["containers"]
    assert c["image"] == "splitserve:router"  # no torch in the planner's imports
    mounts = {vm["mountPath"]: vm for vm in c["volumeMounts"]}
    sa = mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
    assert sa["readOnly"] is True
    (projected,) = [v["projected"] for v in pod["volumes"] if v["name"] == sa["name"]]
    token = projected["sources"][0]["serviceAccountToken"]
    assert token["path"] == "token" and token["expirationSeconds"] <= 3600
    e = env(c)
    assert e["SPLITSERVE_PLANNER_API_KEY"] == {
        "secretKeyRef": {"name": "splitserve-planner-key", "key": "api-key"}
    }
    assert e["SSL_CERT_FILE"] == "/etc/splitserve/tls/ca.crt"  # the router serves HTTPS here
    assert e["SPLITSERVE_REDIS_URL"].startswith("rediss://planner:$(REDIS_PASSWORD)@")  # its own user
    assert e["REDIS_PASSWORD"] == {"secretKeyRef": {"name": f"{FULL}-redis", "key": "planner-password"}}
    # every router pod, at the pod IP it registers; HTTPS checked against the release's CA, not the name
    assert "--discover-routers" in c["args"] and "--no-router-tls-check-hostname" in c["args"]
    assert not any(a.startswith("--router-url") for a in c["args"])
    # the registry's entries are signed: the planner checks them with the internal secret, as a file
    assert e["SPLITSERVE_INTERNAL_SECRET_FILE"] == "/etc/splitserve/secrets/internal/secret"
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes[mounts["/etc/splitserve/secrets/internal"]["name"]]["secret"]
    assert secret["secretName"] == f"{FULL}-internal"
    assert volumes[mounts["/etc/splitserve/tls"]["name"]]["secret"]["items"] == [
        {"key": "ca.crt", "path": "ca.crt"}
    ]


def test_the_planners_arguments_are_what_splitserve_planner_takes(
    rendered: dict[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from planner.kube import KubeActuator
    from planner.main import actuator_from_args, config_from_args
    from splitserve.cli import build_parser

    pod = objects(rendered["planner"])[("Deployment", f"{FULL}-planner")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    for k, v in env(c).items():
        if isinstance(v, str):
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    args = build_parser().parse_args(c["args"])
    config = config_from_args(args)
    assert (config.min_prefill, config.max_prefill, config.min_decode, config.max_decode, config.budget) == (
        1, 4, 2, 6, 8
    )  # fmt: skip
    actuator = actuator_from_args(args, config)
    assert isinstance(actuator, KubeActuator)
    assert actuator.target.namespace == NAMESPACE and actuator.target.api == "https://10.0.0.1:443"
    assert actuator.target.deployments == {"prefill": f"{FULL}-prefill", "decode": f"{FULL}-decode"}
    assert actuator.floors == {"prefill": 1, "decode": 2}


def test_the_planner_reads_the_router_only_with_a_metrics_key_when_keys_are_required() -> None:
    def planner(vals: dict[str, Any]) -> dict[str, Any]:
        m = objects(render({"planner": {"enabled": True}, **vals}))
        (c,) = m[("Deployment", f"{FULL}-planner")]["spec"]["template"]["spec"]["containers"]
        return c

    c = planner({})  # keys required, no key: load signals only
    assert "--discover-routers" not in c["args"]
    assert "SPLITSERVE_PLANNER_API_KEY" not in env(c)
    c = planner({"serviceMonitor": {"apiKeySecret": "prom-key"}})  # Prometheus' key serves it too
    assert "--discover-routers" in c["args"] and "--no-router-tls-check-hostname" not in c["args"]
    assert env(c)["SPLITSERVE_PLANNER_API_KEY"] == {"secretKeyRef": {"name": "prom-key", "key": "api-key"}}
    c = planner({"auth": {"requireApiKey": False, "allowUnauthenticated": True}})
    assert "--discover-routers" in c["args"]
    assert env(c)["SPLITSERVE_REDIS_URL"].startswith("redis://planner:")
    # each router registers its pod IP, where the planner reads its /metrics
    router = container(objects(render({"planner": {"enabled": True}})), "router")
    assert env(router)["SPLITSERVE_ROUTER_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_planner_settings_are_checked() -> None:
    with pytest.raises(Exception, match="budget"):
        render({"planner": {"enabled": True, "minPrefill": 4, "minDecode": 4, "budget": 6}})
    with pytest.raises(Exception, match="planner"):
        render({"planner": {"enabled": True, "minDecode": 0}})  # decode workers serve every request
    with pytest.raises(Exception, match="planner"):
        render({"planner": {"enabled": True, "replicas": 2}})  # not a setting: refused, never ignored


def test_the_forecast_law_gets_its_capacity_table_and_arguments_splitserve_planner_takes(
    tmp_path: Path,
) -> None:
    """planner.law=forecast: the capacity table rendered into a ConfigMap (as `--capacity-table` reads
    it) mounted read-only, the forecast flags, which `splitserve planner` turns into the forecast law; a
    forecast without a table, or without the router's /metrics (its arrivals), is refused at render."""
    from planner.forecast import CapacityTable, ForecastPlanner
    from planner.main import config_from_args, forecast_from_args
    from splitserve.cli import build_parser

    rows = [{"rate_rps": 25, "prefill": 2, "decode": 1}, {"rate_rps": 50.5, "prefill": 3, "decode": 2}]
    vals = {"planner": {"enabled": True, "law": "forecast", "capacityTable": rows, "forecastLeadSeconds": 90}}
    vals |= {"auth": {"requireApiKey": False, "allowUnauthenticated": True}}
    m = objects(render(vals))
    cm = m[("ConfigMap", f"{FULL}-planner-capacity")]
    table = CapacityTable.from_json(json.loads(cm["data"]["capacity.json"]))
    assert [(r.rate_rps, r.prefill, r.decode) for r in table.rows] == [(25.0, 2, 1), (50.5, 3, 2)]
    pod = m[("Deployment", f"{FULL}-planner")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mount = next(v for v in c["volumeMounts"] if v["name"] == "capacity")
    assert mount == {"name": "capacity", "mountPath": "/etc/splitserve/planner", "readOnly": True}
    assert {"name": "capacity", "configMap": {"name": f"{FULL}-planner-capacity"}} in pod["volumes"]
    args = build_parser().parse_args(c["args"])
    assert (args.law, args.capacity_table) == ("forecast", "/etc/splitserve/planner/capacity.json")
    assert (args.forecast_period_s, args.forecast_lead_s) == (86400.0, 90.0)
    (tmp_path / "capacity.json").write_text(cm["data"]["capacity.json"])  # as the pod's mount holds it
    args.capacity_table = str(tmp_path / "capacity.json")
    law = forecast_from_args(args, config_from_args(args), bool(args.router_url or args.discover_routers))
    assert isinstance(law, ForecastPlanner) and law.fc.lead_s == 90.0
    assert ("ConfigMap", f"{FULL}-planner-capacity") not in objects(render({"planner": {"enabled": True}}))
    with pytest.raises(Exception, match="needs planner.capacityTable"):
        render({"planner": {"enabled": True, "law": "forecast"}})
    with pytest.raises(Exception, match="needs the router's /metrics"):
        render({"planner": {"enabled": True, "law": "forecast", "capacityTable": rows}})  # keys, no key
    with pytest.raises(Exception, match="planner"):
        render({"planner": {"enabled": True, "law": "guess"}})
    # several router replicas: every pod's counters are read and summed (--discover-routers)
    two = objects(render({**vals, "router": {"replicas": 2}}))
    (c,) = two[("Deployment", f"{FULL}-planner")]["spec"]["template"]["spec"]["containers"]
    assert "--discover-routers" in c["args"]
