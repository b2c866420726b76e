"""Several models behind one router (router/served_model.py): which model a request's `model` names, the
404 for any other, each model's services sorted apart in the worker pool (router/workers.py), each
request prepared with its own model's template (router/prep.py, inline and in a parse worker), and the
settings that hold for one model only. The same with real processes: tests/integration/test_multi_model.py."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from common.cluster.registry import WorkerInfo
from common.text.model_info import ModelInfo, load_model_info
from router.config import RouterConfig
from router.errors import APIError
from router.prep import Preparation, prepare_generation, prepare_tokenize
from router.served_model import ServedModels
from router.workers import WorkerPool
from tests.support.router_fakes import FakeCluster, make_router, model_info
from tests.support.tiny_model import tiny_model_path

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# a second template: the same messages render to other token ids than SmolLM2's own template gives
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def infos() -> list[ModelInfo]:
    """SmolLM2's tokenizer (GGUF), and the tiny model's folder with a template of its own."""
    return [model_info(), load_model_info(tiny_model_path(), chat_template=OTHER_TEMPLATE)]


def two(infos: list[ModelInfo], *names: str, **config: Any) -> ServedModels:
    return ServedModels.of(RouterConfig(model=["a", "b"], served_model_name=list(names), **config), infos)


def test_each_model_answers_to_its_name_its_id_and_the_first_to_default(infos: list[ModelInfo]) -> None:
    models = two(infos, "smol")  # the second is named by its id
    smol, tiny = models.models
    assert models.names == ["smol", "tiny-random-llama-v1"]
    assert models.lookup("smol") is smol and models.lookup("default") is smol and models.lookup(None) is smol
    assert models.lookup(infos[0].model_id) is smol  # its model id too
    assert models.lookup("tiny-random-llama-v1") is tiny
    assert smol.fingerprint != tiny.fingerprint
    assert models.aliases() == sorted({"smol", "default", infos[0].model_id, "tiny-random-llama-v1"})


def test_an_unknown_model_is_openais_404_model_not_found(infos: list[ModelInfo]) -> None:
    with pytest.raises(APIError) as e:
        two(infos, "a", "b").lookup("gpt-4")
    body = e.value.body()["error"]
    assert e.value.status == 404 and body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "invalid_request_error" and "`a`, `b`" in body["message"]


def test_names_must_pair_up_with_models(infos: list[ModelInfo]) -> None:
    with pytest.raises(ValueError, match="two models are served as 'x'"):
        two(infos, "x", "x")
    with pytest.raises(ValueError, match="two models are served as"):  # one model twice, no names
        ServedModels.of(RouterConfig(model=["a", "a"]), [infos[0], infos[0]])
    same = ServedModels.of(RouterConfig(model=["a", "a"], served_model_name=["p", "q"]), [infos[0]] * 2)
    assert infos[0].model_id not in same.aliases()  # an id two models share names neither


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": ["a", "b"], "decode_urls": ["http://d"]}, "fixed worker lists"),
        ({"model": ["a", "b"], "chat_template": "{{ x }}"}, "chat_template"),
        ({"model": ["a"], "served_model_name": ["x", "y"]}, "2 served model names for 1 models"),
    ],
)
def test_settings_for_one_model_only_are_refused_with_several(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterConfig(**config)


def test_the_environment_lists_models_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_ROUTER_MODEL", "/m/a.gguf, /m/b")
    monkeypatch.setenv("SPLITSERVE_ROUTER_SERVED_MODEL_NAME", "a,b")
    config = RouterConfig()
    assert config.model == ["/m/a.gguf", "/m/b"] and config.served_model_name == ["a", "b"]


# ---- the worker pool: each registered service is one model's ---------------------------------------


class Registry:
    """What the pool reads of the registry: the services alive now."""

    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    async def alive(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == role]


class State:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.registry = Registry(workers)


def service(wid: str, role: str, model: str, tokenizer: str) -> WorkerInfo:
    capacity = {"model": model, "tokenizer": tokenizer, "block_size": 16}
    return WorkerInfo(wid, role, f"http://{wid}", "", capacity, {}, time.time())


async def test_requests_of_a_model_go_to_its_services_only(infos: list[ModelInfo]) -> None:
    models = two(infos, "smol", "tiny")
    fp = infos[0].tokenizer.fingerprint
    state = State([
        service("d-smol", "decode", "smol", fp),
        service("d-tiny", "decode", "tiny", fp),
        service("d-by-id", "decode", "tiny-random-llama-v1", fp),  # registered under its model id
        service("p-tiny", "prefill", "tiny", fp),
        service("d-other", "decode", "llama-70b", fp),  # a model this router does not serve
        service("d-bad-tok", "decode", "smol", "another-tokenizer"),
    ])  # fmt: skip
    pool = WorkerPool(state, [], [])  # type: ignore[arg-type]
    pool.serve(models)
    assert [w.id for w in await pool.candidates("decode", "smol")] == ["d-smol"]
    assert sorted(w.id for w in await pool.candidates("decode", "tiny")) == ["d-by-id", "d-tiny"]
    assert await pool.candidates("prefill", "smol") == []
    assert [w.id for w in await pool.candidates("prefill", "tiny")] == ["p-tiny"]
    assert len(await pool.candidates("decode")) == 3  # every model's (/health)
    assert pool.other_model == {"d-other": "llama-70b"} and list(pool.other_tokenizer) == ["d-bad-tok"]


async def test_with_one_model_a_service_under_another_name_is_still_taken(infos: list[ModelInfo]) -> None:
    fp = infos[0].tokenizer.fingerprint
    pool = WorkerPool(State([service("d", "decode", "whatever", fp)]), [], [])  # type: ignore[arg-type]
    pool.serve(ServedModels.of(RouterConfig(served_model_name=["smol"]), infos[:1]))
    assert [w.id for w in await pool.candidates("decode", "smol")] == ["d"] and not pool.other_model


# ---- preparing a request: the model it names, its template ------------------------------------------


def test_a_request_is_prepared_with_the_model_it_names(infos: list[ModelInfo]) -> None:
    config = RouterConfig(model=["a", "b"], served_model_name=["smol", "tiny"], parse_workers=0)
    prep = Preparation(config, ServedModels.of(config, infos))
    out = {}
    for name in ("smol", "tiny"):
        body = json.dumps({**CHAT, "model": name}).encode()
        prepared = prepare_generation(prep.context, body, True, {}, None)
        parsed = prepared.parsed[0][2]
        assert parsed.model == name
        out[name] = parsed.prompt_ids
        ids = prepare_tokenize(
            prep.context, json.dumps({"model": name, "messages": CHAT["messages"]}).encode()
        )
        assert ids["tokens"] == parsed.prompt_ids  # /tokenize renders with the same model's template
    assert out["smol"] != out["tiny"]  # each model's own template
    assert out["tiny"] == infos[1].tokenizer.encode(
        infos[1].tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True),
        add_special_tokens=False,
    )


async def test_a_parse_worker_prepares_each_model_as_the_loop_does(infos: list[ModelInfo]) -> None:
    config = RouterConfig(
        model=["a", "b"], served_model_name=["smol", "tiny"], parse_workers=1, parse_inline_bytes=0
    )
    models = ServedModels.of(config, infos)
    prep, inline = (
        Preparation(config, models),
        Preparation(config.model_copy(update={"parse_workers": 0}), models),
    )
    try:
        for name in ("smol", "tiny"):
            body = json.dumps({**CHAT, "model": name}).encode()
            far = await prep.run(None, len(body), prepare_generation, body, True, {}, None)
            near = await inline.run(None, len(body), prepare_generation, body, True, {}, None)
            assert (
                far.parsed[0][2].model == name and far.parsed[0][2].prompt_ids == near.parsed[0][2].prompt_ids
            )
        with pytest.raises(APIError) as e:
            body = json.dumps({**CHAT, "model": "gpt-4"}).encode()
            await prep.run(None, len(body), prepare_generation, body, True, {}, None)
        assert e.value.status == 404 and e.value.code == "model_not_found"
    finally:
        await prep.close()


# ---- every endpoint that takes a model: the same 404 -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "gpt-4", **CHAT}),
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
        ("/detokenize", {"model": "gpt-4", "tokens": [1, 2]}),
    ],
)
async def test_every_endpoint_answers_an_unknown_model_with_404(path: str, body: dict[str, Any]) -> None:
    cluster = FakeCluster([1, 2])
    async with make_router(cluster, served_model_name="smol") as client:
        resp = await client.post(path, json=body)
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 404, resp.text
    assert resp.json() == {
        "error": {
            "message": "The model `gpt-4` does not exist; this server serves `smol` (GET /v1/models)",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert not cluster.generate_calls
    if path.startswith("/v1/"):  # counted as refused, under the one model there is
        endpoint = "chat" if "chat" in path else "completions"
        line = f'splitserve_router_requests_total{{endpoint="{endpoint}",model="smol",status="rejected"}} 1.0'
        assert line in metrics


# ---- the command line: --model and --served-model-name once per model -------------------------------


def test_router_and_up_take_one_model_flag_per_model() -> None:
    from splitserve.cli import build_parser
    from splitserve.launch import ConfigError, _up_models

    flags = ["--model", "a.gguf", "--model", "b", "--served-model-name", "x", "--served-model-name", "y"]
    router = build_parser().parse_args(["router", *flags])
    assert (router.model, router.served_model_name) == (["a.gguf", "b"], ["x", "y"])
    up = build_parser().parse_args(["up", *flags])
    assert _up_models(up) == (["a.gguf", "b"], ["x", "y"])
    assert _up_models(build_parser().parse_args(["up"])) == ([None], [])  # the services' default model
    for bad in (
        ["--model", "a", "--model", "b", "--served-model-name", "x"],
        ["--model", "a", "--model", "a"],
    ):
        with pytest.raises(ConfigError):
            _up_models(build_parser().parse_args(["up", *bad]))
