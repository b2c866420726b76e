"""Service settings in containers: bind to 0.0.0.0 but register an address others can reach; an empty
SPLITSERVE_* variable (compose's `${VAR:-}`) means "not set"."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.config import EngineConfig, ServiceConfig
from common.kv.kv_cache import KVCacheSpec, PagedKVCache
from common.protocol import KVCompat
from kv_transfer import make_receiver
from router.config import RouterConfig
from tests.support.kv_helpers import Owner


def test_registered_url_and_name_default_to_the_bind_host() -> None:
    cfg = ServiceConfig(role="prefill", host="127.0.0.1", port=8101)
    assert (cfg.url, cfg.worker_name) == ("http://127.0.0.1:8101", "prefill-127.0.0.1-8101")


def test_advertise_host_from_env_replaces_the_bind_host_in_url_and_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPLITSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("SPLITSERVE_ADVERTISE_HOST", "10.1.2.3")
    cfg = ServiceConfig(role="decode", port=8201)
    assert cfg.host == "0.0.0.0"
    assert (cfg.url, cfg.worker_name) == ("http://10.1.2.3:8201", "decode-10.1.2.3-8201")
    v6 = ServiceConfig(role="decode", port=8201, advertise_host="fd00::7")
    assert v6.url == "http://[fd00::7]:8201"


def test_empty_env_vars_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPLITSERVE_MODEL", "SPLITSERVE_ADVERTISE_HOST", "SPLITSERVE_ROUTER_MODEL"):
        monkeypatch.setenv(name, "")
    assert EngineConfig().model is None
    assert ServiceConfig(role="prefill").advertise_host is None
    assert RouterConfig().model == []


def test_decode_kv_endpoint_carries_the_advertised_host() -> None:
    spec = KVCacheSpec(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=4)
    compat = KVCompat("tiny", "h", str(torch.float32).removeprefix("torch."), 1, 1, 4, 4)

    async def endpoint() -> str:
        rx = make_receiver(
            "tcp",
            PagedKVCache(spec),
            compat,
            Owner(),
            host="127.0.0.1",
            advertise_host="decode-0",
        )
        try:
            return await rx.start()
        finally:
            await rx.close()

    assert asyncio.run(endpoint()).startswith("tcp://decode-0:")


def _service_args(argv: list[str]):  # type: ignore[no-untyped-def]
    import argparse

    from splitserve.launch import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_port_comes_from_the_flag_then_the_environment_then_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.launch import service_configs

    monkeypatch.delenv("SPLITSERVE_PORT", raising=False)
    assert service_configs(_service_args(["prefill"]))[0].port == 8101
    assert service_configs(_service_args(["decode"]))[0].port == 8201
    monkeypatch.setenv("SPLITSERVE_PORT", "9300")
    assert service_configs(_service_args(["decode"]))[0].port == 9300
    assert service_configs(_service_args(["decode", "--port", "9400"]))[0].port == 9400
    cfg, engine = service_configs(
        _service_args(["prefill", "--device", "cpu", "--gpu-memory-utilization", "0.5"])
    )
    assert (cfg.role, engine.device, engine.gpu_memory_utilization) == ("prefill", "cpu", 0.5)
