"""Tenants as a bounded metrics label, the security span events and the registered-workers gauge, at the
router (router/access.py, router/metrics.py): what each request adds, what the cap does, what a scrape
reads (and that it never asks Redis)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from router.access import Access
from router.auth.keys import ApiKey, Limits
from router.auth.ratelimit import Decision
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import DEFAULT_MAX_TENANTS, RouterMetrics, TenantLabels
from tests.support.router_fakes import FakeCluster, FakeState, make_router, model_info

pytestmark = pytest.mark.anyio
USER_A = "tenant-a-key-for-the-metrics-test-012345"
USER_B = "tenant-b-key-for-the-metrics-test-012345"
NO_SCOPE = "metrics-only-key-for-the-metrics-test-01"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def samples(metrics: RouterMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return parse(metrics.render().decode(), name)


def parse(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def tenant_requests(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    return {
        (dict(k)["tenant"], dict(k)["status"]): v
        for k, v in samples(metrics, "splitserve_router_tenant_requests_total").items()
    }


def tenant_tokens(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    return {
        (dict(k)["tenant"], dict(k)["kind"]): v
        for k, v in samples(metrics, "splitserve_router_tenant_tokens_total").items()
    }


def key(tenant: str, key_id: str = "k_1", limits: Limits | None = None) -> ApiKey:
    return ApiKey(key_id, "n", tenant, frozenset({"inference"}), limits or Limits(), 0.0, None)


# ---- the bounded label -------------------------------------------------------------------------------


def test_the_first_tenants_keep_their_name_the_rest_are_other() -> None:
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "_other", "a", "_other", "b"]
    assert labels(None) == "_none"
    assert labels("_other") == labels("_none") == "_other"  # the reserved values keep their meaning
    assert [TenantLabels(0)(t) for t in ("a", None)] == ["_other", "_none"]
    assert TenantLabels().limit == DEFAULT_MAX_TENANTS == RouterConfig().metrics_max_tenants == 20


def test_the_cap_is_a_router_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_ROUTER_METRICS_MAX_TENANTS", "3")
    config = RouterConfig()
    assert config.metrics_max_tenants == 3
    metrics = RouterMetrics()
    Access(config, None, "splitserve:", metrics)
    assert metrics.tenants.limit == 3
    with pytest.raises(ValueError):
        RouterConfig(metrics_max_tenants=-1)


async def test_admit_and_release_count_requests_and_tokens_per_bounded_tenant() -> None:
    metrics = RouterMetrics()
    access = Access(RouterConfig(metrics_max_tenants=1), None, "splitserve:", metrics)
    assert tenant_requests(metrics) == {} and tenant_tokens(metrics) == {}  # no tenant known yet

    a = await access.admit(key("team-a"), "r1", 10 + 100, prompt_tokens=10)
    assert a.tenant == "team-a" and not a.charged and a.headers == {}
    # its first request makes all of the tenant's children: a 429 or token panel reads 0, not "no data"
    assert tenant_requests(metrics) == {("team-a", "accepted"): 1, ("team-a", "rate_limited"): 0}
    assert tenant_tokens(metrics) == {("team-a", "prompt"): 0, ("team-a", "output"): 0}
    await access.release(a, 10 + 7)
    assert tenant_tokens(metrics) == {("team-a", "prompt"): 10, ("team-a", "output"): 7}

    b = await access.admit(key("team-b"), "r2", 5 + 5, prompt_tokens=5)  # over the cap of 1
    none = await access.admit(None, "r3", 3 + 5, prompt_tokens=3)  # auth off: no key, no tenant
    await access.release(b, 5 + 5)
    await access.release(none, 3 + 1)
    assert (b.tenant, none.tenant) == ("_other", "_none")
    assert tenant_requests(metrics) == {
        ("team-a", "accepted"): 1, ("team-a", "rate_limited"): 0,
        ("_other", "accepted"): 1, ("_other", "rate_limited"): 0,
        ("_none", "accepted"): 1, ("_none", "rate_limited"): 0,
    }  # fmt: skip
    assert tenant_tokens(metrics) == {
        ("team-a", "prompt"): 10, ("team-a", "output"): 7,
        ("_other", "prompt"): 5, ("_other", "output"): 5,
        ("_none", "prompt"): 3, ("_none", "output"): 1,
    }  # fmt: skip

    # a request that failed before its prompt was all counted: never more prompt than was used
    c = await access.admit(key("team-a"), "r4", 50, prompt_tokens=40)
    await access.release(c, 0)
    assert tenant_tokens(metrics)[("team-a", "prompt")] == 10
    # a caller that does not say how many prompt tokens: no made-up split
    d = await access.admit(key("team-a"), "r5", 50)
    await access.release(d, 30)
    assert tenant_tokens(metrics) == {
        ("team-a", "prompt"): 10, ("team-a", "output"): 7,
        ("_other", "prompt"): 5, ("_other", "output"): 5,
        ("_none", "prompt"): 3, ("_none", "output"): 1,
    }  # fmt: skip
    await access.release(None, 5)  # nothing admitted: nothing counted


class FakeLimiter:
    """RateLimiter's acquire/release with the decision the test chooses (or an outage)."""

    def __init__(self) -> None:
        self.decision = Decision(True, 0.0, "", {"x-ratelimit-limit-requests": "2"})
        self.down = False
        self.released: list[tuple[str, int, int]] = []

    async def acquire(self, key: ApiKey, request_id: str, tokens: int, hold_s: float) -> Decision:
        if self.down:
            raise ConnectionError("redis is away")
        return self.decision

    async def release(self, key: ApiKey, request_id: str, charged: int, used: int) -> None:
        self.released.append((request_id, charged, used))


@pytest.fixture
def exporter() -> Iterator[tuple[InMemorySpanExporter, Any]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield spans, provider.get_tracer("test")


def events(span: ReadableSpan) -> list[tuple[str, dict[str, Any]]]:
    return [(e.name, dict(e.attributes or {})) for e in span.events]


async def test_rate_limited_requests_count_for_their_tenant_with_a_span_event(
    exporter: tuple[InMemorySpanExporter, Any],
) -> None:
    spans, tracer = exporter
    metrics = RouterMetrics()
    access = Access(RouterConfig(), None, "splitserve:", metrics)
    limiter = access.limiter = FakeLimiter()  # type: ignore[assignment]
    limited = key("team-a", "k_lim", Limits(rpm=2))

    ok = await access.admit(limited, "r1", 30, prompt_tokens=10)
    assert ok.charged and ok.charged_tokens == 30 and ok.headers == {"x-ratelimit-limit-requests": "2"}
    await access.release(ok, 10 + 4)
    assert limiter.released == [("r1", 30, 14)]
    assert tenant_tokens(metrics) == {("team-a", "prompt"): 10, ("team-a", "output"): 4}

    limiter.decision = Decision(False, 12.0, "requests", {})
    with tracer.start_as_current_span("POST /v1/completions"), pytest.raises(APIError) as e:
        await access.admit(limited, "r2", 30, prompt_tokens=10)
    assert e.value.status == 429
    (span,) = spans.get_finished_spans()
    assert events(span) == [
        (
            "splitserve.rate_limited",
            {"splitserve.limit": "requests", "splitserve.tenant": "team-a", "splitserve.key_id": "k_lim"},
        )
    ]
    assert tenant_requests(metrics) == {("team-a", "accepted"): 1, ("team-a", "rate_limited"): 1}
    assert samples(metrics, "splitserve_router_rate_limited_total")[(("limit", "requests"),)] == 1

    limiter.down = True  # Redis away: served unmetered, counted as accepted, nothing to give back
    unmetered = await access.admit(limited, "r3", 30, prompt_tokens=10)
    assert not unmetered.charged
    await access.release(unmetered, 12)
    assert limiter.released == [("r1", 30, 14)]
    assert tenant_requests(metrics) == {("team-a", "accepted"): 2, ("team-a", "rate_limited"): 1}
    assert samples(metrics, "splitserve_router_rate_limits_unenforced_total") == {(): 1}


def request(authorization: str | None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


async def test_auth_refusals_add_a_span_event_and_count_no_tenant(
    tmp_path: Path, exporter: tuple[InMemorySpanExporter, Any]
) -> None:
    spans, tracer = exporter
    keys = tmp_path / "keys"
    keys.write_text(f"{USER_A} name=a tenant=team-a\n{NO_SCOPE} name=m scopes=metrics\n")
    metrics = RouterMetrics()
    access = Access(RouterConfig(api_keys_file=str(keys)), None, "splitserve:", metrics)
    inference = access.require("inference")
    for authorization, status in ((None, 401), ("Bearer sk-wrong", 401), (f"Bearer {NO_SCOPE}", 403)):
        with tracer.start_as_current_span("POST /v1/completions"), pytest.raises(APIError) as e:
            await inference(request(authorization))
        assert e.value.status == status
    got = [events(s) for s in spans.get_finished_spans()]
    forbidden = {"splitserve.reason": "forbidden", "splitserve.scope": "inference"}
    assert got[:2] == [
        [("splitserve.auth_refused", {"splitserve.reason": "missing"})],
        [("splitserve.auth_refused", {"splitserve.reason": "unknown"})],
    ]
    ((name, attrs),) = got[2]
    assert name == "splitserve.auth_refused" and forbidden.items() <= attrs.items()
    assert attrs["splitserve.key_id"].startswith("file-")
    assert tenant_requests(metrics) == {}  # refused before any tenant is known
    assert (await inference(request(f"Bearer {USER_A}"))) is not None


# ---- through the app ---------------------------------------------------------------------------------


async def test_the_routers_metrics_show_tenants_bounded_by_the_setting(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(
        f"{USER_A} name=a tenant=team-a\n{USER_B} name=b tenant=team-b\n{NO_SCOPE} scopes=metrics\n"
    )
    out = model_info().tokenizer.encode("fine thanks", add_special_tokens=False)
    async with make_router(FakeCluster(out), api_keys_file=str(keys), metrics_max_tenants=1) as client:
        for secret in (USER_A, USER_B, USER_A):
            r = await client.post(
                "/v1/completions",
                json={"model": "default", "prompt": "hi"},
                headers={"Authorization": f"Bearer {secret}"},
            )
            assert r.status_code == 200, r.text
        assert (
            await client.post("/v1/completions", json={"model": "default", "prompt": "hi"})
        ).status_code == 401
        text = (await client.get("/metrics", headers={"Authorization": f"Bearer {NO_SCOPE}"})).text
    got = {
        (dict(k)["tenant"], dict(k)["status"]): v
        for k, v in parse(text, "splitserve_router_tenant_requests_total").items()
    }
    assert got == {
        ("team-a", "accepted"): 2, ("team-a", "rate_limited"): 0,
        ("_other", "accepted"): 1, ("_other", "rate_limited"): 0,
    }  # fmt: skip
    kinds = {dict(k)["kind"] for k in parse(text, "splitserve_router_tenant_tokens_total")}
    assert kinds == {"prompt", "output"}


async def test_registered_workers_read_the_pools_last_list_at_scrape_time() -> None:
    state = FakeState()
    state.registry.workers = {"decode": [("decode", {})], "prefill": [("prefill", {}), ("prefill-2", {})]}
    cluster = FakeCluster([1, 2], state=state)

    def workers(text: str) -> dict[str, float]:
        got = parse(text, "splitserve_router_registered_workers")
        return {dict(k)["worker_role"]: v for k, v in got.items()}

    calls: list[str] = []
    alive = state.registry.alive

    async def counted(role: str) -> list[Any]:
        calls.append(role)
        return await alive(role)

    state.registry.alive = counted  # type: ignore[method-assign]
    async with make_router(cluster, static=False) as client:
        assert workers((await client.get("/metrics")).text) == {"prefill": 0, "decode": 0}  # none read yet
        assert not calls  # a scrape never asks Redis
        health = (await client.get("/health")).json()
        assert (health["decode_workers"], health["prefill_workers"]) == (1, 2)
        n = len(calls)
        assert workers((await client.get("/metrics")).text) == {"prefill": 2, "decode": 1}
        state.registry.workers["prefill"] = []  # gone from the registry: seen at the next read
        assert workers((await client.get("/metrics")).text) == {"prefill": 2, "decode": 1}
        assert len(calls) == n


def test_registered_workers_never_fail_a_scrape() -> None:
    class Broken:
        stale_reads = 0

        def known(self, role: str) -> int:
            raise RuntimeError("no")

    class Orch:
        config = RouterConfig()
        records = owners = None
        pool = Broken()

    metrics = RouterMetrics()
    metrics.watch(Orch())
    got = samples(metrics, "splitserve_router_registered_workers")
    assert set(got) == {(("worker_role", "prefill"),), (("worker_role", "decode"),)}
    assert all(math.isnan(v) for v in got.values())


async def test_static_worker_lists_count_as_registered() -> None:
    async with make_router(FakeCluster([1]), decodes=("d1", "d2"), prefills=()) as client:
        text = (await client.get("/metrics")).text
    got = {dict(k)["worker_role"]: v for k, v in parse(text, "splitserve_router_registered_workers").items()}
    assert got == {"decode": 2, "prefill": 0}
