"""Schemathesis against the router's own OpenAPI document: bodies generated from the request schemas
of /v1/completions and /v1/chat/completions (valid and invalid, streaming and not), and every other
route, through the real router app with fake services behind it. Whatever comes in: no 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.support.router_fakes import FakeCluster, model_info, router_app

OUT = model_info().tokenizer.encode("Hello there, how are you?", add_special_tokens=False)
APP = router_app(FakeCluster(OUT), request_timeout_s=20)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_router_fail(case) -> None:  # type: ignore[no-untyped-def]
    case.call_and_validate(checks=[not_a_server_error])
