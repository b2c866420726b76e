"""A tiny real server for tests of process start-up (bench/serving.py Stack, tests/support/cluster.py):
binds 127.0.0.1:--port and answers GET /health with 200 and an empty JSON object, as the services answer
theirs; with --ports N, the next N - 1 ports too, one after another once the first answered a health
check (as a sim-fleet's later services start while its first already answers). Exits with the bind
error's message (as uvicorn words it: "address already in use") when a port is taken."""

from __future__ import annotations

import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

ASKED = threading.Event()  # a health check was answered


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"{}" if self.path == "/health" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if body:
            ASKED.set()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ports", type=int, default=1)
    args = parser.parse_args()
    servers = []
    for port in range(args.port, args.port + args.ports):
        try:
            server = HTTPServer(("127.0.0.1", port), _Health)
        except OSError as e:
            where = f"('127.0.0.1', {port})"
            print(f"error while attempting to bind on address {where}: address already in use ({e})")
            return 3
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        if len(servers) == 1 and args.ports > 1:
            ASKED.wait(30)  # the rest only once the first answered a health check (the case to test)
    threading.Event().wait()  # until killed
    return 0


if __name__ == "__main__":
    sys.exit(main())
