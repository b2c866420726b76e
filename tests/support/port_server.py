"""A tiny real server for tests of process start-up (bench/serving.py Stack, tests/support/cluster.py):
binds 127.0.0.1:--port and answers GET /health with 200 and an empty JSON object, as the services answer
theirs; exits with the bind error's message (as uvicorn words it: "address already in use") when the
port is taken."""

from __future__ import annotations

import argparse
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"{}" if self.path == "/health" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    try:
        server = HTTPServer(("127.0.0.1", port), _Health)
    except OSError as e:
        print(
            f"error while attempting to bind on address ('127.0.0.1', {port}): address already in use ({e})"
        )
        return 3
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
