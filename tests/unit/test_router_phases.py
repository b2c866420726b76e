"""The router's request phases on their own, without HTTP or services (router/request.py calls them in
order; tests/unit/test_router_flow.py runs them together against fake services)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from router.config import RouterConfig
from router.errors import APIError
from router.openai_types import ChatCompletionRequest, CompletionRequest
from router.output import Output
from router.parse import parse, read
from router.response import usage
from router.served_model import ServedModel
from tests.support.router_fakes import model_info


@pytest.fixture(scope="module")
def served() -> ServedModel:
    return ServedModel.of(RouterConfig(), model_info())


def test_parse_gives_what_the_later_phases_read(served: ServedModel) -> None:
    req = read(
        b'{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}', True
    )
    assert isinstance(req, ChatCompletionRequest)
    headers = {
        "x-splitserve-tenant": "acme",
        "x-splitserve-priority": "-2",
        "x-splitserve-ttft-slo-ms": "300",
    }
    parsed = parse(req, headers, None, served, RouterConfig())
    assert parsed.chat and parsed.prompt_ids and parsed.sampling.max_tokens == 7
    assert (parsed.tenant, parsed.priority, parsed.targets.ttft_ms) == ("acme", -2, 300.0)
    assert parsed.echo is None and not parsed.score_only and parsed.tool_mode is None


def test_parse_scores_an_echoed_prompt_with_max_tokens_0(served: ServedModel) -> None:
    req = read(
        b'{"model": "default", "prompt": "Hi there", "echo": true, "max_tokens": 0, "logprobs": 1}', False
    )
    assert isinstance(req, CompletionRequest)
    parsed = parse(req, {}, None, served, RouterConfig())
    assert parsed.echo == "Hi there" and parsed.score_only
    assert parsed.sampling.max_tokens == 1 and parsed.sampling.prompt_logprobs == 1  # one token, dropped


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        (b'{"model": "default", "prompt": "Hi", "stop": ["' + b"x" * 300 + b'"]}', {}, "stop"),
        (b'{"model": "default", "prompt": "Hi"}', {"x-splitserve-priority": "soon"}, "x-splitserve-priority"),
        (b'{"model": "default", "prompt": "Hi", "max_tokens": 0}', {}, "max_tokens"),
        (b'{"model": "default", "prompt": [1, 2, 99999999]}', {}, "prompt"),
    ],
)
def test_parse_refuses_with_a_400_naming_the_param(
    served: ServedModel, body: bytes, headers: dict[str, str], param: str
) -> None:
    with pytest.raises(APIError) as refused:
        parse(read(body, False), headers, None, served, RouterConfig())
    assert refused.value.status == 400 and refused.value.param == param


def test_the_output_takes_each_token_once_in_order() -> None:
    out = Output([1, 2, 3], SamplingParams(max_tokens=8))
    assert out.accept(0, [10]) == [10] and out.accept(1, [11, 12]) == [11, 12]
    assert out.tokens == [1, 2, 3, 10, 11, 12]  # what a placement after a migration sends
    with pytest.raises(APIError) as late:
        out.accept(1, [11])  # a frame repeated: never shown to the client twice
    assert late.value.status == 502 and out.ids == [10, 11, 12]


def test_usage_is_one_computation_for_one_choice_or_several() -> None:
    def job(prompt: int, output: int, cached: int) -> Any:
        trip = SimpleNamespace(output=SimpleNamespace(num_cached_tokens=cached))
        return SimpleNamespace(
            parsed=SimpleNamespace(prompt_ids=[0] * prompt),
            run=SimpleNamespace(output_tokens=output),
            trip=trip,
        )

    one, two = job(5, 3, 2), job(5, 4, 0)
    details = {"cached_tokens": 2}
    assert usage([one]) == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": details,
    }  # fmt: skip
    assert usage([one, two]) == {
        "prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17, "prompt_tokens_details": details,
    }  # fmt: skip
