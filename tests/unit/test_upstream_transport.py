"""router.upstream.SettledTransport: a connection closed as it is made is a transport error, like httpx's."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from router.upstream import SettledTransport, post_abort
from router.workers import Worker
from tests.support.router_fakes import model_info


def _closed_as_made(request: httpx.Request) -> httpx.Response:
    # what anyio raises when the socket of a connection is gone as it is made (the service was killed)
    raise AttributeError("'NoneType' object has no attribute 'getpeername'")


def test_an_attribute_error_from_the_connection_becomes_a_connect_error() -> None:
    async def go() -> None:
        async with httpx.AsyncClient(transport=SettledTransport(httpx.MockTransport(_closed_as_made))) as c:
            with pytest.raises(httpx.ConnectError, match="closed as it was made"):
                await c.post("http://127.0.0.1:1/internal/abort", content=b"x")

    asyncio.run(go())


def test_answers_pass_through() -> None:
    async def go() -> httpx.Response:
        inner = httpx.MockTransport(lambda r: httpx.Response(200, content=r.content))
        async with httpx.AsyncClient(transport=SettledTransport(inner)) as c:
            return await c.post("http://127.0.0.1:1/x", content=b"hello")

    r = asyncio.run(go())
    assert r.status_code == 200 and r.content == b"hello"


def test_a_best_effort_abort_on_a_service_dying_as_it_connects_does_not_raise() -> None:
    """The soak test's failure: an abort sent to a prefill service being killed ended the client's
    request with a 500 (the AttributeError escaped post_abort)."""

    async def go() -> None:
        async with httpx.AsyncClient(transport=SettledTransport(httpx.MockTransport(_closed_as_made))) as c:
            await post_abort(c, Worker(id="prefill-0", url="http://127.0.0.1:1"), "cmpl-1")

    asyncio.run(go())


def test_the_routers_own_client_uses_it() -> None:
    """The wiring the fix depends on: the client create_app makes for the services (none was given)."""
    app = create_app(RouterConfig(), None, model_info())
    assert isinstance(app.state.server.orch.client._transport, SettledTransport)
