"""A small OpenAI-compatible stand-in server (stdlib only) for the launcher and bench tests.

``python standin_server.py --port P [--ready-after S] [--ready-file PATH] [--answer TEXT]
[--exit-after S] [--tokens N] [--token-delay S] [--first-delay S]``: ``/v1/models`` answers 503
until ``--ready-after`` seconds have passed and, with ``--ready-file``, until that file exists (a
test decides when the server is ready, instead of guessing a time); chat completions answer ``--answer`` (non-streaming) or
stream ``--tokens`` chunks ``--token-delay`` apart after ``--first-delay``, with a usage chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready-after", type=float, default=0.0)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--answer", default="Paris.")
    ap.add_argument("--exit-after", type=float, default=None)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--token-delay", type=float, default=0.005)
    ap.add_argument("--first-delay", type=float, default=0.05)
    ap.add_argument("--model", default="qwen")
    a = ap.parse_args()
    print("stand-in: loading weights", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path != "/v1/models":
                return self._json(404, {"error": "not found"})
            if time.monotonic() - START < a.ready_after or (a.ready_file and not os.path.exists(a.ready_file)):
                return self._json(503, {"error": "loading"})
            self._json(200, {"object": "list", "data": [{"id": a.model, "object": "model"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": "not found"})
            if req.get("model") != a.model:
                return self._json(404, {"error": f"model {req.get('model')!r} does not exist"})
            if not req.get("stream"):
                return self._json(200, {"choices": [{"message": {"role": "assistant", "content": a.answer}}],
                                        "usage": {"completion_tokens": 2}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(a.first_delay)
            n = min(a.tokens, req.get("max_tokens") or a.tokens)
            for i in range(n):
                if i:
                    time.sleep(a.token_delay)
                ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    if a.exit_after is not None:
        def _die():
            time.sleep(a.exit_after)
            print("stand-in: CUDA out of memory (simulated)", flush=True)
            os._exit(3)
        threading.Thread(target=_die, daemon=True).start()
    print(f"stand-in: serving on {a.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
