"""The dashboard and the alerts, proven by the real programs: real Prometheus servers (Debian's 2.42,
fetched by tests/support/prometheus.py; skipped where it cannot be) scrape a real router, prefill and
decode service and load deploy/prometheus/rules.yaml. One scrapes as compose does (deploy/prometheus.yml:
its job names and `role` labels, the router's /metrics behind a bearer key with the metrics scope), the
other as the chart's ServiceMonitors do (jobs named after the release's Services, a namespace label, no
`role`). The services run with KV offload tiers (RAM and disk). After split, local, failed, cancelled,
unauthenticated, rate-limited and forged requests of two tenants (the router names one:
METRICS_MAX_TENANTS=1), on both, every expression of the Grafana dashboard returns a series, every rule
evaluates without error, and the alerts that must be active are."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from common.cluster.redis_server import RedisServer
from tests.support.cluster import Cluster, Proc, free_port, get_json, wait_until
from tests.support.prometheus import Prometheus, Unavailable, dashboard_targets, substitute, tools

pytestmark = pytest.mark.services
ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
# static API keys (the router's keys file): Prometheus' (metrics only), a user's (tenant team-a), one of
# tenant team-b limited to 1 rpm
METRICS_KEY = "metrics-key-for-prometheus-0123456789"
USER_KEY = "user-key-for-the-observability-test-0123"
LIMITED_KEY = "limited-key-one-request-a-minute-01234"
# more than 32 tokens (the router's local_prefill_threshold): the split path
LONG = (
    "Explain, step by step and with small examples, how a paged KV cache lets one inference server batch "
    "many requests of very different lengths without wasting memory, and what it costs."
)
STALL_S = 3.0


@dataclass
class Stack:
    prefill: Proc
    decode: Proc
    router: Proc
    prometheus: dict[str, Prometheus]  # by layout: "compose", "chart"
    cluster: Cluster


LAYOUTS = ("compose", "chart")
CHART_JOB = "llm-splitserve-{}"  # release llm: the chart's Services, which name the ServiceMonitors' jobs


def prometheus_config(layout: str, ports: dict[str, int], key_file: Path) -> str:
    """deploy/prometheus.yml with this test's targets, its key file and a 1 s rhythm; for "chart", with
    the job names and target labels the Prometheus Operator gives the chart's ServiceMonitor targets."""
    cfg = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    assert {j["job_name"] for j in cfg["scrape_configs"]} == {
        f"splitserve-{c}" for c in ("router", "prefill", "decode")
    }
    for job in cfg["scrape_configs"]:
        component = job["job_name"].removeprefix("splitserve-")
        # compose finds the prefill/decode replicas by DNS; here one of each listens on loopback
        job.pop("dns_sd_configs", None)
        (sc,) = job.setdefault("static_configs", [{}])
        sc["targets"] = [f"127.0.0.1:{ports[component]}"]
        if layout == "chart":
            job["job_name"] = CHART_JOB.format(component)
            sc["labels"] = {
                "namespace": "serving",
                "service": job["job_name"],
                "endpoint": "http",
                "pod": f"{component}-0",
            }
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(key_file)
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        prom_bin = tools().prometheus
    except Unavailable as e:
        pytest.skip(f"no Prometheus: {e}")
    tmp = tmp_path_factory.mktemp("observability")
    keys = tmp / "api-keys"
    keys.write_text(
        f"{METRICS_KEY} name=prometheus scopes=metrics\n"
        f"{USER_KEY} name=user tenant=team-a\n"
        f"{LIMITED_KEY} name=limited tenant=team-b rpm=1\n"
    )
    (tmp / "metrics-key").write_text(METRICS_KEY)
    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    proms: dict[str, Prometheus] = {}
    for layout in LAYOUTS:
        (tmp / layout / "prometheus").mkdir(parents=True)
        (tmp / layout / "prometheus/rules.yaml").write_text(
            (ROOT / "deploy/prometheus/rules.yaml").read_text()
        )
        config = prometheus_config(layout, ports, tmp / "metrics-key")
        proms[layout] = Prometheus(prom_bin, tmp / layout, config, free_port())
    redis = RedisServer(port=free_port()).start()  # its own: no other module's workers in the registry
    c = Cluster(redis.url, str(tmp))
    try:
        # both with KV offload tiers (one disk folder, a slot each): the KV tiers row has its series
        tiers = ("--kv-offload-ram-gb", "0.01", "--kv-offload-disk-dir", str(tmp / "kv-tiers"),
                 "--kv-offload-disk-gb", "0.01")  # fmt: skip
        with ThreadPoolExecutor(2) as pool:  # both load the model at once
            p = pool.submit(c.start, "prefill", *FLAGS, *tiers, port=ports["prefill"])
            d = pool.submit(c.start, "decode", *FLAGS, *tiers, port=ports["decode"])
            prefill, decode_ = p.result(), d.result()
        router = c.start(
            "router",
            "--require-api-key",
            "--api-keys-file", str(keys),
            "--decode-stall-s", str(STALL_S),
            "--max-migrations", "0",  # a stalled decode stream fails its request: a real failure
            env={
                "SPLITSERVE_ROUTER_SLO_TTFT_MS": "1",  # every request misses: the TTFT burn alert
                "SPLITSERVE_ROUTER_METRICS_MAX_TENANTS": "1",  # team-a comes first; team-b is _other
            },
            port=ports["router"],
        )  # fmt: skip
        for prom in proms.values():
            prom.wait_ready()
        wait_until(
            lambda: (
                get_json(router.url + "/health")["prefill_workers"] >= 1
                and get_json(router.url + "/health")["decode_workers"] >= 1
            ),
            30,
            "the router to see both services",
        )
        yield Stack(prefill, decode_, router, proms, c)
    finally:
        for proc in list(c.procs):
            if proc.popen.poll() is None:
                os.kill(proc.popen.pid, signal.SIGCONT)
        c.stop()
        for prom in proms.values():
            prom.stop()
        redis.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def traffic(s: Stack) -> dict[str, int]:
    """Split, local, cancelled, failed, refused and forged requests; the status of each kind."""
    url = s.router.url + "/v1/completions"
    seen: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=120, headers=auth(USER_KEY)) as client:
        split = await asyncio.gather(*(
            client.post(url, json={"model": "default", "prompt": f"{LONG} ({i})", "max_tokens": 8})
            for i in range(3)
        ))  # fmt: skip
        for r in split:
            assert r.status_code == 200 and r.headers["x-splitserve-route"].startswith("split"), r.text
        local = await client.post(url, json={"model": "default", "prompt": "Hi", "max_tokens": 8})
        assert local.headers["x-splitserve-route"] == "local; reason=short_prompt", local.text
        chat = await client.post(
            s.router.url + "/v1/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "stream": True,
            },
        )
        assert chat.status_code == 200 and "[DONE]" in chat.text

        # cancelled: the client leaves after its first token
        body = {
            "model": "default",
            "prompt": "Count to a thousand.",
            # still generating when the client leaves on the tiny model, and short enough that a
            # request not stopped at once would not hold the decode service past the rate window
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        # failed: the decode service freezes mid-stream; no migration allowed, so the stream errors out
        body = {**body, "max_tokens": 1000}
        events: list[str] = []
        try:
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 1:
                            os.kill(s.decode.popen.pid, signal.SIGSTOP)
        finally:
            os.kill(s.decode.popen.pid, signal.SIGCONT)
        assert any('"error"' in e for e in events), events[-3:]

    async with httpx.AsyncClient(timeout=60) as anonymous:
        seen["no key"] = (await anonymous.post(url, json={"model": "default", "prompt": "Hi"})).status_code
        for _ in range(2):
            r = await anonymous.post(
                url, json={"model": "default", "prompt": "Hi", "max_tokens": 1}, headers=auth(LIMITED_KEY)
            )
        seen["over the limit"] = r.status_code
        # a call to a service's internal API without the internal secret's signature
        r = await anonymous.post(s.decode.url + "/internal/generate", content=b"\x00")
        seen["unsigned internal call"] = r.status_code
    return seen


@pytest.fixture(scope="module")
def served(stack: Stack) -> Stack:
    """The stack after the traffic, every request ended, and scraped and evaluated since."""
    s = stack
    # every target scraped once before any traffic: each counter's first sample is its 0, so rate()
    # sees the rise (on the tiny model the traffic can otherwise end before the first scrape)
    before = time.time()
    for prom in s.prometheus.values():
        prom.wait_scraped_after(before)
    seen = asyncio.run(traffic(s))
    assert seen == {"no key": 401, "over the limit": 429, "unsigned internal call": 401}, seen
    for proc in (s.prefill, s.decode):  # every request ended: nothing held (the stalled one freed too)
        h = s.cluster.wait_blocks_free(proc, timeout_s=15)
        assert h["free_blocks"] == h["total_blocks"] and h["running"] == 0, (proc.role, h)
    done = time.time()
    for prom in s.prometheus.values():
        prom.wait_scraped_after(done)
    after = time.time()
    for prom in s.prometheus.values():
        prom.wait_evaluated_after(after)
    return s


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_dashboard_query_returns_a_series_and_the_rules_work(served: Stack, layout: str) -> None:
    s, prom = served, served.prometheus[layout]
    router_job = "splitserve-router" if layout == "compose" else CHART_JOB.format("router")

    # 1. every expression of every panel, as Grafana would send it, has at least one series
    dash = json.loads((ROOT / "deploy/grafana/splitserve.json").read_text())
    empty = [
        f"{title}: {expr}"
        for title, expr in dashboard_targets(dash)
        if not prom.query(substitute(expr, dash))
    ]
    assert not empty, "panels with no data:\n" + "\n".join(empty)

    # 2. what happened shows as what it was
    counts = {
        'sum(splitserve_router_requests_total{status="finished"})': 6,  # 3 split, 2 local, 1 limited
        'sum(splitserve_router_requests_total{status="cancelled"})': 1,
        'sum(splitserve_router_requests_total{status="failed"})': 1,
        'sum(splitserve_router_route_decisions_total{route="split"})': 3,
        'sum(splitserve_router_migrations_total{reason="gave_up"})': 1,
        'sum(splitserve_router_auth_refused_total{reason="missing"})': 1,
        'sum(splitserve_router_rate_limited_total{limit="requests"})': 1,
        'sum(splitserve_internal_auth_refused_total{job=~".*splitserve-decode",reason="missing"})': 1,
        'sum(splitserve_kv_transfer_dones_total{job=~".*splitserve-decode"})': 3,
        # by tenant: team-a's 7 requests (3 split, 2 local, cancelled, failed); team-b's past the cap
        'sum(splitserve_router_tenant_requests_total{tenant="team-a",status="accepted"})': 7,
        'sum(splitserve_router_tenant_requests_total{tenant="team-a",status="rate_limited"})': 0,
        'sum(splitserve_router_tenant_requests_total{tenant="_other",status="accepted"})': 1,
        'sum(splitserve_router_tenant_requests_total{tenant="_other",status="rate_limited"})': 1,
        "count(count by (tenant) (splitserve_router_tenant_requests_total))": 2,  # no team-b, no _none
        "count(count by (tenant, kind) (splitserve_router_tenant_tokens_total))": 4,
        'sum(splitserve_router_registered_workers{worker_role="prefill"})': 1,
        'sum(splitserve_router_registered_workers{worker_role="decode"})': 1,
    }
    got = {expr: prom.value(expr) for expr in counts}
    assert got == {expr: float(n) for expr, n in counts.items()}, got
    bandwidth = next(
        expr for title, expr in dashboard_targets(dash) if title.startswith("KV transfer bandwidth")
    )
    (series,) = prom.query(substitute(bandwidth, dash))  # the prefill service's line only
    assert series["metric"]["instance"] == f"127.0.0.1:{s.prefill.url.rsplit(':', 1)[1]}"
    assert float(series["value"][1]) > 0

    # 3. every rule evaluates cleanly against the real series; the SLO ratios are recorded per router job
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/rules.yaml").read_text())["groups"]
    assert len(rules) == sum(len(g["rules"]) for g in shipped)
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken
    labels = {"job": router_job} | ({"namespace": "serving"} if layout == "chart" else {})
    for slo in ("ttft", "tpot"):
        for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
            name = f"splitserve:slo_{slo}_errors:ratio_rate{window}"
            (ratio,) = prom.query(name)
            assert ratio["metric"] == {"__name__": name, **labels}, ratio
    assert prom.value("splitserve:slo_ttft_errors:ratio_rate5m") >= 1  # a 1 ms TTFT objective: all miss
    assert prom.value("splitserve:slo_tpot_errors:ratio_rate5m") == 0  # no TPOT objective: none

    # 4. the alerts: the TTFT budget burns (pending: `for: 2m`); the unsigned internal call fires at once;
    # no leaked KV blocks, decode is up and registered, one 429 and one 401 are no spike
    active = {(a["labels"]["alertname"], a["state"]) for a in prom.api("alerts")["alerts"]}
    assert active & {("SplitserveTTFTBudgetBurn", "pending"), ("SplitserveTTFTBudgetBurn", "firing")}, active
    assert ("SplitserveInternalAuthRefused", "firing") in active, active
    quiet = {
        "SplitserveKVBlocksLeaked",
        "SplitserveNoDecodeService",
        "SplitserveTPOTBudgetBurn",
        "SplitservePrefillNotRegistered",
        "SplitserveNoDecodeRegistered",
        "SplitserveAuthRefusalsSpike",
        "SplitserveRateLimitsUnenforced",
        "SplitserveTenantRateLimited",
        "SplitserveKVTierVerifyFailures",
    }
    assert not {name for name, _ in active} & quiet, active
