"""Engine faults are per request (issue 31, "Security round 2"), against a real Redis, prefill, decode and
router. The fault is a real input, not a switch: a temperature so small (1e-40, which the API accepts:
0 <= t <= 2) that the logits divided by it overflow and the draw raises ("probability tensor contains
inf, nan ..."). Before, any exception in a step exited the service (status 70): one key holder's request
took down every stream on the decode service and the prefill service with it. Now the engine finds the
request that raises (the step's sequences run again, halves at a time), fails it with the reason and
runs the rest of the step: the service stays up, its other streams go on token for token.

Token ids outside the model's vocabulary (a signed internal call can carry any) are refused with a 400
before they reach the engine (on a GPU an embedding out of range is a device assert: no step survives it).
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import httpx
import pytest

from common.cluster.redis_server import RedisServer
from common.protocol import (
    DecodeFrame,
    ErrorFrame,
    FrameReader,
    GenerateRequest,
    Reserved,
    TokenFrame,
    encode,
)
from common.sampling_params import SamplingParams
from tests.support.cluster import Cluster, Proc, free_port, get_json, internal_auth, wait_until

pytestmark = pytest.mark.services
FLAGS = ("--threads", "1", "--kv-cache-mb", "64")
TINY_TEMPERATURE = 1e-40
LONG = " ".join(f"word{i}" for i in range(60))  # over the 32-token local-prefill threshold: the split path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    redis = RedisServer(port=free_port()).start()
    c = Cluster(redis.url, str(tmp_path_factory.mktemp("logs")))
    try:
        prefill = c.start("prefill", *FLAGS)
        decode_ = c.start("decode", *FLAGS)
        router = c.start("router")
        c.wait_routed()
        yield prefill, decode_, router
    finally:
        c.stop()
        redis.stop()


class Stream(threading.Thread):
    """One streaming completion through the router: its chunks, text and finish reason as they come."""

    def __init__(self, router: Proc, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.router, self.body = router, {**body, "stream": True}
        self.chunks, self.text, self.finish, self.status, self.error = 0, "", None, 0, ""

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.router.url + "/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    self.chunks += 1
                    self.text += choice.get("text", "")
                    self.finish = choice.get("finish_reason") or self.finish
        except Exception as e:
            self.error = repr(e)


def alive(proc: Proc) -> dict[str, Any]:
    assert proc.popen.poll() is None, f"{proc.role} exited with {proc.popen.returncode}:\n{proc.log_tail()}"
    return get_json(proc.url + "/health")  # type: ignore[no-any-return]


def logged(proc: Proc, *needles: str) -> bool:
    with open(proc.log_path) as f:
        return any(all(n in line for n in needles) for line in f)


def test_a_request_the_engine_fails_on_fails_alone(stack) -> None:  # type: ignore[no-untyped-def]
    prefill, decode_, router = stack
    before = {p.role: alive(p)["incarnation"] for p in (prefill, decode_)}
    good = Stream(router, {"model": "default", "prompt": "Once upon a time", "max_tokens": 120,
                           "temperature": 0, "ignore_eos": True})  # fmt: skip
    good.start()
    wait_until(lambda: good.chunks >= 3 or not good.is_alive(), 60, "the good stream to generate")

    # split path: the prefill service's engine fails on it (500), the router's transfer-failure policy
    # prefills it on the decode service instead, whose engine fails on it too, next to the good stream
    bad = {"model": "default", "prompt": LONG, "max_tokens": 8, "temperature": TINY_TEMPERATURE}
    r = httpx.post(router.url + "/v1/completions", json=bad, timeout=120)
    assert r.status_code == 502, r.text
    rid = r.headers["x-request-id"]

    good.join(120)
    assert good.status == 200 and not good.error, (good.status, good.error)
    assert good.finish == "length" and good.chunks >= 100  # every token: it was never interrupted
    after = {p.role: alive(p)["incarnation"] for p in (prefill, decode_)}
    assert after == before  # the same processes: nothing exited
    for p in (prefill, decode_):
        assert logged(p, rid, "the engine failed on this request", "probability tensor"), p.log_tail()

    def recorded() -> dict[str, Any] | None:
        rec = get_json(f"{router.url}/v1/requests/{rid}")
        return rec if rec.get("state") == "failed" else None

    wait_until(lambda: recorded() is not None, 10, "the request's record to say failed")
    # both services serve on, on both paths
    for prompt in ("The weather today", LONG):
        body = {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        ok = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
        assert ok.status_code == 200, ok.text


def generate(decode_: Proc, token_ids: list[int], params: SamplingParams) -> tuple[int, list[Any]]:
    """A signed /internal/generate (local mode) straight to the decode service: its status, its frames."""
    req = GenerateRequest(uuid.uuid4().hex, token_ids, params, mode="local")
    frames: list[Any] = []
    with (
        httpx.Client(timeout=60, auth=internal_auth) as c,
        c.stream("POST", decode_.url + "/internal/generate", content=encode(req)) as r,
    ):
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        reader = FrameReader(DecodeFrame)
        try:
            for chunk in r.iter_bytes():
                frames += reader.feed(chunk)
        except httpx.HTTPError as e:  # the process went away mid-stream
            frames.append(e)
    return r.status_code, frames


def test_the_reason_reaches_the_caller(stack) -> None:  # type: ignore[no-untyped-def]
    _, decode_, _ = stack
    tiny = SamplingParams(max_tokens=4, temperature=TINY_TEMPERATURE)
    status, frames = generate(decode_, [1, 2, 3, 4, 5], tiny)
    assert status == 200 and isinstance(frames[0], Reserved), frames
    assert isinstance(frames[-1], ErrorFrame), frames
    assert frames[-1].code == 500 and "the engine failed on this request" in frames[-1].error
    assert "probability tensor" in frames[-1].error
    alive(decode_)
    status, frames = generate(decode_, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert isinstance(frames[-1], TokenFrame) and frames[-1].finish_reason == "length", frames


def test_token_ids_outside_the_vocabulary_are_refused_before_the_engine(stack) -> None:  # type: ignore[no-untyped-def]
    _, decode_, _ = stack
    incarnation = alive(decode_)["incarnation"]
    status, body = generate(decode_, [1, 2, 10**7], SamplingParams(max_tokens=4))
    assert status == 400 and "token ids must be in [0," in body[0]["error"]["message"], (status, body)
    status, body = generate(decode_, [1, -3, 2], SamplingParams(max_tokens=4))
    assert status == 400, (status, body)
    # before, the step that met the id raised and the process exited: a request after them still runs
    status, frames = generate(decode_, [1, 2, 3], SamplingParams(max_tokens=2))
    assert status == 200 and frames[-1].finish_reason == "length", (status, frames)
    assert alive(decode_)["incarnation"] == incarnation
