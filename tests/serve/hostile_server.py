"""A server that answers what no protocol allows (stdlib only, run as a child process): the stand-in at
the network boundary for the HTTP client's tests.

``python hostile_server.py --answer KIND [--on PATH] [--location URL] [--record FILE]``: binds a free
port on 127.0.0.1, prints ``READY <port>`` and serves until killed. A request to ``--on`` (a path
prefix; default every path) gets ``KIND``:

- ``json-metrics``: a JSON object (as gateways answer every GET), ``html``: a web page,
- ``truncated``: ``Content-Length`` promises more than is sent, then the connection closes,
- ``bad-utf8``: JSON with bytes that are not UTF-8, ``nested``: 100,000 nested JSON lists,
- ``huge``: 200 MB of JSON-looking bytes without a ``Content-Length``,
- ``302``/``307``: a redirect to ``--location``, ``models``: a correct model list (``qwen``).

Other paths: ``/v1/models`` answers the model list, a chat completion streams one token, the rest
404. With ``--record`` every request's method, path and headers are appended to FILE as a JSON
line (the redirect target).
"""
from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODELS = json.dumps({"object": "list", "data": [{"id": "qwen", "object": "model"}]}).encode()
HUGE = 200 * 10 ** 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answer", default="models")
    ap.add_argument("--on", default="/")
    ap.add_argument("--location", default="")
    ap.add_argument("--record", default="")
    a = ap.parse_args()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json", length: int | None = None):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            if a.record:
                with open(a.record, "a") as f:
                    seen = {"method": self.command, "path": self.path, "headers": dict(self.headers)}
                    f.write(json.dumps(seen) + "\n")
            if not self.path.startswith(a.on):
                if self.path.startswith("/v1/models"):
                    return self._send(200, MODELS)
                if self.path.startswith("/v1/chat/completions"):  # one token, streamed
                    event = {"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {"completion_tokens": 1}}
                    return self._send(200, f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode(),
                                      "text/event-stream")
                return self._send(404, b'{"detail": "Not Found"}')
            kind = a.answer
            if kind == "models":
                self._send(200, MODELS)
            elif kind == "json-metrics":
                self._send(200, b'{"data": [{"id": "gateway"}], "status": "ok"}')
            elif kind == "html":
                self._send(200, b"<!DOCTYPE html><html><body><h1>Sign in</h1></body></html>", "text/html")
            elif kind == "truncated":
                self._send(200, b'{"object": "list", "data": [{"id": "qw', length=4096)
                self.close_connection = True
            elif kind == "bad-utf8":
                self._send(200, b'{"object": "list", "data": [{"id": "\xff\xfe\xc3("}]}')
            elif kind == "nested":
                self._send(200, b"[" * 100_000 + b"]" * 100_000)
            elif kind == "huge":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                chunk = b'{"data": [' + b" " * (1 << 20)
                try:
                    for _ in range(HUGE // len(chunk)):
                        self.wfile.write(chunk)
                except OSError:
                    pass
                self.close_connection = True
            elif kind in ("302", "307"):
                self.send_response(int(kind))
                self.send_header("Location", a.location + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._send(200, b"{}")

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"READY {server.server_port}", flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
