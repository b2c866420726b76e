"""docs/operations.md lists every environment variable the services read, and the deploy docs point
at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from common.config import EngineConfig, ServiceConfig
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_documented_as_an_environment_variable() -> None:
    ops = (ROOT / "docs/operations.md").read_text()
    names = {f"SPLITSERVE_{f.upper()}" for cls in (EngineConfig, ServiceConfig) for f in cls.model_fields}
    names |= {f"SPLITSERVE_ROUTER_{f.upper()}" for f in RouterConfig.model_fields}
    missing = sorted(n for n in names if f"`{n}`" not in ops)
    assert not missing, f"document {missing} in docs/operations.md, 'Environment variables'"


def test_deploy_docs_name_files_that_exist() -> None:
    text = (ROOT / "docs/operations.md").read_text() + (ROOT / "helm/splitserve/README.md").read_text()
    named = r"`((?:deploy|helm|tests)/[\w./-]+|compose(?:\.(?:cpu|tp))?\.yaml|Dockerfile)`"
    paths = set(re.findall(named, text))
    compose = {"compose.yaml", "compose.cpu.yaml", "compose.tp.yaml"}
    assert compose | {"Dockerfile", "deploy/otel-collector.yaml"} <= paths
    for p in paths:
        if "*" not in p:
            assert (ROOT / p).exists(), p
    for values in (ROOT / "helm/splitserve/ci").glob("*-values.yaml"):
        assert f"ci/{values.name}" in text, f"helm/splitserve/README.md: no example uses {values.name}"
