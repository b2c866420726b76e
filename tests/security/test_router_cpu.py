"""Work the router does for a request before any service sees it is bounded by the input's length, not
paid in full for inputs that can never be served (issue 31, point 1, in part): a prompt or /tokenize
input longer than any prompt the model can take is refused from its length alone, before the tokenizer
runs (the message says "at least N tokens", which only that check writes). Real router process."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import Cluster

pytestmark = pytest.mark.services

BIG = "lorem ipsum " * 600_000  # 7.2 MB of text: millions of tokens, in a body under the 8 MiB limit


@pytest.fixture(scope="module")
def router(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        yield c.start("router", "--decode-urls", "http://127.0.0.1:9")
    finally:
        c.stop()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "default", "prompt": BIG}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": BIG}]},
            "messages",
        ),
        ("/tokenize", {"model": "default", "prompt": BIG}, "prompt"),
        ("/tokenize", {"model": "default", "messages": [{"role": "user", "content": BIG}]}, "messages"),
    ],
)
def test_an_input_too_long_for_any_context_is_refused_before_tokenizing(router, path, body, param) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(router.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "at least" in err["message"], err  # the length check's, not the tokenizer's count
    # an input that fits is tokenized as before
    small = httpx.post(
        router.url + "/tokenize", json={"model": "default", "prompt": "lorem ipsum"}, timeout=60
    )
    assert small.status_code == 200 and small.json()["count"] > 0
