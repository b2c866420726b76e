"""The least an HTTP hop in Python can cost: the baseline `bench serving` measures the router against.

A bare ASGI app on the router's own server stack (uvicorn with uvloop and httptools) and HTTP client
(httpx, calls signed with the cluster secret). For each POST it parses the JSON body (`prompt_ids`,
`max_tokens`), opens the decode service's /internal/generate stream, reads frames until the request
finishes and answers the token ids as JSON. No validation, tokenization, routing, Redis, middleware,
tracing or metrics: what is left is the second HTTP hop itself, so the router's overhead over this
floor is what the router's own work costs.

Run: `python -m bench.hop_floor --port 8100 --decode-url http://127.0.0.1:8200` (GET /health answers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import httpx

from common.protocol import DecodeFrame, ErrorFrame, FrameReader, GenerateRequest, TokenFrame, encode
from common.sampling_params import SamplingParams
from common.security.internal_auth import SignedCalls
from common.security.secret import InternalSecret

JSON = [(b"content-type", b"application/json")]


def make_app(decode_url: str) -> Any:
    """The floor's ASGI app, forwarding to `decode_url`."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), auth=SignedCalls(InternalSecret.from_env())
    )
    ids = itertools.count()
    prefix = f"floor-{os.getpid()}-"

    async def generate(body: bytes) -> tuple[int, bytes]:
        req = json.loads(body)
        sampling = SamplingParams(max_tokens=int(req.get("max_tokens", 1)), temperature=0.0, ignore_eos=True)
        msg = GenerateRequest(
            f"{prefix}{next(ids)}", list(req["prompt_ids"]), sampling, mode="local", deadline=time.time() + 60
        )
        url = f"{decode_url}/internal/generate"
        headers = {"content-type": "application/msgpack"}
        tokens: list[int] = []
        async with client.stream("POST", url, content=encode(msg), headers=headers) as resp:
            if resp.status_code != 200:
                return 502, json.dumps({"error": f"decode service answered {resp.status_code}"}).encode()
            reader = FrameReader(DecodeFrame)
            async for chunk in resp.aiter_raw():
                for f in reader.feed(chunk):
                    if isinstance(f, ErrorFrame):
                        return 502, json.dumps({"error": f.error}).encode()
                    if isinstance(f, TokenFrame):
                        tokens.extend(f.token_ids)
                        if f.finished:
                            return 200, json.dumps({"token_ids": tokens}).encode()
        return 502, b'{"error": "decode stream ended before the request finished"}'

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":
            status, out = 200, b'{"status": "ok"}'
        else:
            chunks, more = [], True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            status, out = await generate(b"".join(chunks))
        await send({"type": "http.response.start", "status": status, "headers": JSON})
        await send({"type": "http.response.body", "body": out})

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--decode-url", required=True)
    args = p.parse_args(argv)
    uvicorn.run(
        make_app(args.decode_url.rstrip("/")), host=args.host, port=args.port, loop="uvloop",
        http="httptools", log_level="warning", access_log=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
