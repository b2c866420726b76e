"""The prompt work the router counts against a worker (WorkerPool.in_flight_tokens: placement weighs it
as that worker's queue until its heartbeat catches up, router/placement.py) is held while a prefill call
or a local route's prompt runs, and let go of on every way a request leaves it: answered, failed over,
fallen back. A leak would make a worker look busier with every request it served."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.workers import WorkerPool
from tests.support.router_fakes import FakeCluster, StreamingASGITransport, model_info, router_app

pytestmark = pytest.mark.anyio
LONG_PROMPT = "one two three four five six seven eight nine ten " * 8  # > 32 tokens: split path


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=StreamingASGITransport({"router": app}), base_url="http://router")


def _ids() -> list[int]:
    return model_info().tokenizer.encode("Hello there, and the end.", add_special_tokens=False)


@pytest.mark.parametrize(
    ("prompt", "prefills", "failing", "route"),
    [
        (LONG_PROMPT, ("prefill",), (), "split"),
        ("Hi", ("prefill",), (), "local; reason=short_prompt"),
        (LONG_PROMPT, (), (), "local; reason=no_prefill_worker"),
        (LONG_PROMPT, ("p1", "p2"), ("p1",), "split"),  # retried on p2
        (LONG_PROMPT, ("prefill",), ("prefill",), "local; reason=prefill_failed"),
    ],
)
async def test_prompt_work_is_let_go_of_on_every_path(
    prompt: str, prefills: tuple[str, ...], failing: tuple[str, ...], route: str
) -> None:
    cluster = FakeCluster(_ids())
    cluster.failing.update(failing)
    app = router_app(cluster, prefills=prefills)
    pool: WorkerPool = app.state.server.orch.pool
    seen: list[dict[str, int]] = []
    hold = pool.hold

    def spy(worker: Any, tokens: int = 0) -> None:
        hold(worker, tokens)
        seen.append(dict(pool.in_flight_tokens))

    pool.hold = spy  # type: ignore[method-assign]
    async with _client(app) as client:
        for stream in (False, True):
            body = {"model": "default", "prompt": prompt, "max_tokens": 8, "stream": stream}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200 and resp.headers["x-splitserve-route"] == route
            assert not pool.in_flight_tokens and not pool.in_flight, (pool.in_flight_tokens, pool.in_flight)
    # the prompt's tokens were counted while it ran: on the prefill service, or on the decode service
    # that computed it itself (a split route's decode stream holds no prompt work)
    assert any(held for held in seen), seen
