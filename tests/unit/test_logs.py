"""Logging (common/runtime/logs.py) and the access log (common/runtime/access.py): the text and JSON
formats, escaping (no log line can be forged: issue 31.6), request ids, the CLI's accepted values,
uvicorn routed through our handler, progress for model loading."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.testclient import TestClient

from common.runtime import logs
from common.runtime.access import AccessLog
from common.runtime.http_server import server_config
from common.runtime.logs import configure_logging, escape, progress, request_id_var

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ \S+ \S+( \[[^\]]+\])?: ")
FORGED = "1999-01-01T00:00:00.000Z INFO decode-0 splitserve.access: forged"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """configure_logging's output, for a test that configures it; everything undone afterwards."""
    root = logging.getLogger()
    level = root.level
    out = io.StringIO()
    yield out
    logs.reset_logging()
    root.setLevel(level)


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def records(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in lines(out)]


# --- formats ------------------------------------------------------------------------------------------
def test_text_format_names_time_level_process_logger(stream: io.StringIO) -> None:
    configure_logging("info", "text", process="decode-0", stream=stream)
    logging.getLogger("splitserve.test").info("hello %s", "world")
    logging.getLogger("splitserve.test").debug("not at info")
    (line,) = lines(stream)
    assert TEXT_LINE.match(line), line
    assert line.endswith(" INFO decode-0 splitserve.test: hello world")


def test_json_format_one_object_per_line(stream: io.StringIO) -> None:
    configure_logging("debug", "json", process="router", stream=stream)
    log = logging.getLogger("splitserve.test")
    log.debug("first")
    token = request_id_var.set("req-abc")
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("second")
    finally:
        request_id_var.reset(token)
    first, second = records(stream)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert {k: first[k] for k in ("level", "process", "logger", "msg")} == {
        "level": "debug",
        "process": "router",
        "logger": "splitserve.test",
        "msg": "first",
    }
    assert "request_id" not in first and "exc" not in first
    assert second["level"] == "error" and second["request_id"] == "req-abc"
    assert "RuntimeError: boom" in second["exc"]


def test_configure_is_idempotent_and_keeps_the_process_name(stream: io.StringIO) -> None:
    configure_logging("info", "text", process="prefill-1", stream=stream)
    configure_logging("info", "json", stream=stream)
    logging.getLogger("x").warning("once")
    (rec,) = records(stream)  # one handler, not two
    assert rec["process"] == "prefill-1" and rec["msg"] == "once"


def test_defaults_come_from_the_environment(stream: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("SPLITSERVE_LOG_FORMAT", "json")
    configure_logging(stream=stream)
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert [r["msg"] for r in records(stream)] == ["shown"]
    assert logs.LOG_LEVELS == ("debug", "info", "warning", "error", "critical")
    assert logs.LOG_FORMATS == ("text", "json")


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        (
            {"level": "verbose"},
            {},
            "log level 'verbose': expected one of debug, info, warning, error, critical",
        ),
        ({"fmt": "xml"}, {}, "log format 'xml': expected one of text, json"),
        ({}, {"SPLITSERVE_LOG_LEVEL": "loud"}, "SPLITSERVE_LOG_LEVEL='loud': expected one of debug, info"),
        ({}, {"SPLITSERVE_LOG_FORMAT": "yaml"}, "SPLITSERVE_LOG_FORMAT='yaml': expected one of text, json"),
    ],
)
def test_an_unknown_level_or_format_is_one_line(
    stream: io.StringIO, monkeypatch: pytest.MonkeyPatch, kwargs: dict, env: dict, message: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:
        configure_logging(stream=stream, **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not logs.is_configured()


# --- escaping -----------------------------------------------------------------------------------------
def test_escape() -> None:
    assert escape("a\nb\rc\td\x1b[31m\x00\x7f\x85\u2028é") == "a\\nb\\rc\\td\\x1b[31m\\x00\\x7f\\x85\\u2028é"
    assert escape(escape("x\ny")) == escape("x\ny")  # twice is once


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_field_can_forge_a_line(stream: io.StringIO, fmt: str) -> None:
    configure_logging("info", fmt, process="decode\n" + FORGED, stream=stream)
    token = request_id_var.set("req\r\n" + FORGED)
    try:
        logging.getLogger("evil\n" + FORGED).info("message\n%s\x1b[2J", FORGED)
        try:
            raise ValueError("bad input\n" + FORGED)
        except ValueError:
            logging.getLogger("x").exception("failed on\r\n%s", FORGED)
    finally:
        request_id_var.reset(token)
    out = lines(stream)
    assert not any(line.startswith(FORGED[:10]) for line in out)
    assert "\x1b" not in stream.getvalue() and "\r" not in stream.getvalue()
    if fmt == "json":
        first, second = records(stream)  # exactly two lines, both whole objects
        assert first["msg"] == f"message\n{FORGED}\x1b[2J"  # the content itself kept
        assert FORGED in second["exc"]
    else:
        heads = [line for line in out if not line.startswith("  | ")]
        assert len(heads) == 2 and all(
            line.startswith(("2", "3")) for line in heads
        )  # a time, this millennium
        assert heads[0].endswith(
            " INFO decode\\n"
            + FORGED
            + " evil\\n"
            + FORGED
            + " [req\\r\\n"
            + FORGED
            + "]: message\\n"
            + FORGED
            + "\\x1b[2J"
        )
        # the traceback follows its record, every line of it indented, the forged one too
        assert all(line.startswith("  | ") for line in out[2:]) and len(out) > 3
        assert out[-1] == "  | " + FORGED


# --- access log and request ids -----------------------------------------------------------------------
def make_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(AccessLog)

    @app.get("/plain")
    async def plain() -> PlainTextResponse:
        logging.getLogger("splitserve.test").info("handling")
        return PlainTextResponse("ok")

    @app.get("/named")
    async def named(request: Request) -> PlainTextResponse:
        request.state.request_id = "cmpl-42"  # what the router and the services do once they know it
        logging.getLogger("splitserve.test").info("handling")
        return PlainTextResponse("ok")

    @app.get("/own-header")
    async def own_header() -> JSONResponse:
        return JSONResponse({}, headers={"x-request-id": "chatcmpl-7"})

    @app.get("/bad-id")
    async def bad_id(request: Request) -> PlainTextResponse:
        request.state.request_id = "id\nwith é and spaces"  # a caller's message id, fuzzed
        return PlainTextResponse("ok")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/fail")
    async def fail() -> PlainTextResponse:
        raise RuntimeError("handler bug")

    return app


def access_lines(out: io.StringIO) -> list[dict]:
    return [r for r in records(out) if r["logger"] == "splitserve.access"]


def test_every_line_of_a_request_carries_its_id(stream: io.StringIO) -> None:
    configure_logging("info", "json", process="decode-0", stream=stream)
    client = TestClient(make_app())
    r = client.get("/plain?x=1")
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-")
    handling, access = (r for r in records(stream) if r["logger"].startswith("splitserve"))
    assert handling["msg"] == "handling" and handling["request_id"] == rid
    assert access["request_id"] == rid
    assert access["msg"].startswith("GET /plain?x=1 200 ") and access["msg"].endswith(" ms testclient:50000")
    assert (access["method"], access["path"], access["status"], access["client"]) == (
        "GET",
        "/plain?x=1",
        200,
        "testclient:50000",
    )
    assert access["duration_ms"] >= 0
    assert request_id_var.get() is None  # not left behind


def test_the_handler_names_the_id(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    client = TestClient(make_app())
    assert client.get("/named").headers["x-request-id"] == "cmpl-42"
    handling, access = records(stream)
    assert handling["request_id"] == access["request_id"] == "cmpl-42"
    r = client.get("/own-header")
    assert r.headers.get_list("x-request-id") == ["chatcmpl-7"]  # not a second one
    assert access_lines(stream)[-1]["request_id"] == "chatcmpl-7"


def test_an_id_that_is_no_header_token_does_not_cost_the_response(stream: io.StringIO) -> None:
    """A request id a caller put in its message (control characters, non-ASCII) cannot go into a header:
    the server would refuse to send the response at all (the internal fuzzer found it). The answer keeps
    its status and gets a fresh id."""
    configure_logging("info", "json", stream=stream)
    r = TestClient(make_app()).get("/bad-id")
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req-")
    assert access_lines(stream)[-1]["request_id"] == r.headers["x-request-id"]


def test_a_path_with_a_newline_is_one_escaped_line(stream: io.StringIO) -> None:
    configure_logging("info", "text", process="decode-0", stream=stream)
    client = TestClient(make_app())
    r = client.get("/a%0a1999-01-01T00:00:00.000Z%20INFO%20forged%0d%1b[2J?q=%0a")
    assert r.status_code == 404
    (line,) = lines(stream)
    assert TEXT_LINE.match(line)
    assert (
        f"[{r.headers['x-request-id']}]: GET /a\\n1999-01-01T00:00:00.000Z INFO forged\\r\\x1b[2J?q=%0a"
        in line
    )
    assert " 404 " in line


def test_probes_are_logged_at_debug(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    client = TestClient(make_app())
    client.get("/health")
    assert access_lines(stream) == []
    configure_logging("debug", "json", stream=stream)
    client.get("/health")
    (line,) = access_lines(stream)
    assert line["level"] == "debug" and line["path"] == "/health"


def test_an_unhandled_error_is_logged_with_its_request(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    with pytest.raises(RuntimeError):
        TestClient(make_app()).get("/fail")
    error, access = access_lines(stream)
    assert "RuntimeError: handler bug" in error["exc"] and error["request_id"] == access["request_id"]
    assert access["status"] == 500
    # with error_app (the router's), the client gets that answer, with the request's id
    app = make_app()
    app.user_middleware.clear()
    app.add_middleware(AccessLog, error_app=lambda: JSONResponse({"error": "internal"}, status_code=500))
    r = TestClient(app).get("/fail")
    assert r.status_code == 500 and r.json() == {"error": "internal"}
    assert access_lines(stream)[-1]["request_id"] == r.headers["x-request-id"]


# --- uvicorn and the libraries ------------------------------------------------------------------------
def test_uvicorn_logs_through_our_handler(stream: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_GC_FREEZE", "0")  # the notify below must not freeze this test process
    configure_logging("info", "json", process="router", stream=stream)
    served: list[str] = []
    app = FastAPI()
    app.state.on_serving = served.append
    # what the CLI passes: uvicorn must neither reconfigure logging nor drop its info lines
    config = server_config(app, "127.0.0.1", 8123, log_level="warning")
    assert config.log_config is None and config.access_log is False
    logging.getLogger("uvicorn.error").info("Started server process [1]")
    logging.getLogger("uvicorn.error").info("Uvicorn running on http://127.0.0.1:8123")  # ours says it
    logging.getLogger("uvicorn.access").info("uvicorn's own access line")  # off: AccessLog writes ours
    (rec,) = records(stream)
    assert rec["logger"] == "uvicorn.error" and rec["msg"] == "Started server process [1]"
    assert rec["process"] == "router"
    notify = config.callback_notify
    assert notify is not None

    async def tick_twice() -> None:
        await notify()
        await notify()

    asyncio.run(tick_twice())
    assert served == ["http://127.0.0.1:8123"]  # once


def test_noisy_libraries_stay_at_warning_unless_debug(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    logging.getLogger("httpx").info("HTTP Request: GET ...")
    logging.getLogger("httpcore.connection").debug("connect_tcp.started")
    logging.getLogger("nixl.api").info("Initialized NIXL agent")  # routed, at our level
    warnings.warn("a warning becomes a record", UserWarning, stacklevel=1)
    msgs = [r["msg"] for r in records(stream)]
    assert msgs[0] == "Initialized NIXL agent"
    assert "a warning becomes a record" in msgs[1] and len(msgs) == 2
    configure_logging("debug", "json", stream=stream)
    logging.getLogger("httpx").info("HTTP Request: GET ...")
    assert records(stream)[-1]["msg"] == "HTTP Request: GET ..."


# --- progress -----------------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_two_lines_off_a_terminal(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    assert list(progress(range(5), "loading x", unit="tensor")) == [0, 1, 2, 3, 4]
    start, end = (r["msg"] for r in records(stream))
    assert start == "loading x: 5 tensors ..."
    assert re.fullmatch(r"loading x: 5 tensors in \d+\.\d s", end)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_progress_bar_on_a_terminal_in_text_only(
    stream: io.StringIO, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr("sys.stderr", tty)
    configure_logging("info", fmt, stream=stream)
    assert list(progress(range(3), "dequantizing y")) == [0, 1, 2]
    if fmt == "text":
        assert "dequantizing y:" in tty.getvalue() and "/3 [" in tty.getvalue()  # tqdm's bar
        assert lines(stream) == []
    else:
        assert tty.getvalue() == "" and len(records(stream)) == 2


def model_lines(out: io.StringIO) -> list[str]:
    return [r["msg"] for r in records(out) if r["logger"] == "splitserve.model"]


def test_loading_the_tiny_model_shows_its_progress(stream: io.StringIO) -> None:
    from safetensors import safe_open

    from common.model.loader import load_model
    from tests.conftest import TINY_MODEL

    name = Path(TINY_MODEL).name
    n = 0
    for f in Path(TINY_MODEL).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            n += len(fh.keys())
    configure_logging("info", "json", stream=stream)
    load_model(TINY_MODEL)
    msgs = model_lines(stream)
    assert msgs[:2] == [f"loading model {TINY_MODEL} ...", f"loading {name}: {n} tensors ..."]
    assert re.fullmatch(rf"loading {name}: {n} tensors in \d+\.\d s", msgs[2])
    assert re.fullmatch(rf"model loaded: {name}, 4 layers, \d+ MB of weights \(float32\), \d+\.\d s", msgs[3])


def write_tiny_gguf(path: Path, layers: int = 2, hidden: int = 16, heads: int = 2, inter: int = 32) -> int:
    """A GGUF file the loader takes (llama, a 28-token BPE vocabulary, random f32 weights); returns its
    number of tensors."""
    tokens = ["<|endoftext|>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "ab"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    hd = hidden // heads
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.{name}": shape
            for name, shape in {
                "attn_norm": (hidden,),
                "ffn_norm": (hidden,),
                "attn_q": (hidden, hidden),
                "attn_k": (hd, hidden),
                "attn_v": (hd, hidden),
                "attn_output": (hidden, hidden),
                "ffn_gate": (inter, hidden),
                "ffn_up": (inter, hidden),
                "ffn_down": (hidden, inter),
            }.items()
        }
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(shapes)


def test_loading_a_gguf_shows_its_dequantization(stream: io.StringIO, tmp_path: Path) -> None:
    from common.model.loader import load_model

    path = tmp_path / "tiny.gguf"
    n = write_tiny_gguf(path)
    configure_logging("info", "json", stream=stream)
    model, _ = load_model(str(path), dtype=torch.float32)
    msgs = model_lines(stream)
    assert msgs[0] == f"loading model {path} ..."
    assert re.fullmatch(rf"tiny.gguf: header and tokenizer read, {n} tensors, \d+\.\d s", msgs[1])
    assert msgs[2] == f"dequantizing tiny.gguf: {n} tensors ..."
    assert re.fullmatch(rf"dequantizing tiny.gguf: {n} tensors in \d+\.\d s", msgs[3])
    assert re.fullmatch(
        r"model loaded: tiny.gguf, 2 layers, 0\.\d\d MB of weights \(float32\), \d+\.\d s", msgs[4]
    )
    assert model.config.num_layers == 2
