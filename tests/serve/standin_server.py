"""A small OpenAI-compatible stand-in server (stdlib only) for the launcher and bench tests.

``python standin_server.py --port P [--ready-after S] [--ready-file PATH] [--answer TEXT]
[--exit-after S] [--tokens N] [--token-delay S] [--first-delay S] [--spec-tokens K]
[--accepted A,B,...] [--no-metrics]``: ``/v1/models`` answers 503 until ``--ready-after`` seconds
have passed and, with ``--ready-file``, until that file exists (a test decides when the server is
ready, instead of guessing a time); chat completions answer ``--answer`` (non-streaming) or stream
``--tokens`` tokens after ``--first-delay``, one engine step every ``--token-delay``, with a usage
chunk.

``/metrics`` is vLLM's Prometheus exposition (``Engine.render``: the counters, label names and
text format of vLLM 0.23-0.33 with prometheus_client, `_created` series included; a ``vllm``-marked
test renders the same counts through vLLM's own ``SpecDecodingProm`` and compares). With
``--spec-tokens K`` the stand-in speculates as vLLM does: the prefill step gives the first token,
then every step drafts K tokens, accepts the next number of ``--accepted`` (cycled) and emits the
accepted tokens plus the bonus token in one chunk, advancing ``vllm:spec_decode_*`` as it goes.
Without it there are no spec counters, as on a vLLM serving without a speculative config.

``/v1/completions`` with ``--reference ARTIFACT`` answers a prompt of token ids that is one of the
artifact's reference texts (``validate/reference.py``) with ``prompt_logprobs`` as vLLM 0.23-0.33 do:
entry 0 null, then per position a dict keyed by token id (a string) holding the top-k and the actual
token, each ``{"logprob", "rank", "decoded_token"}``, taken from the reference's ``--side`` (hybrid).
``echo`` + ``logprobs: k`` gives the same plus the legacy string-keyed ``top_logprobs``. To simulate
servers: ``--logprob-noise X`` (a correct server whose kernels move every log-probability by N(0, X)),
``--corrupt`` (each position answers another position's distribution: what a loader that ignores
``weight_scale_inv`` gives), ``--no-prompt-logprobs`` (null, and only the legacy echo form),
``--legacy-echo`` (``prompt_logprobs`` ignored; only ``echo`` + ``logprobs`` answers). Reading the
reference needs torch and safetensors (the project's venv); the rest is stdlib.

With ``VLLM_API_KEY`` in its environment the stand-in wants that key, as vLLM's OpenAI server does
(``AuthenticationMiddleware``): every request under ``/v1`` without ``Authorization: Bearer KEY``
gets 401 ``{"error": "Unauthorized"}``; ``/metrics`` stays open.

``FakeServer`` / ``FakeNetwork`` are the same stand-in in process, behind a fake ``urlopen`` and
a fake clock, for tests whose assertions are exact arithmetic on times.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()
GUARDED_PREFIX = ("/v1", "/v2", "/inference")  # vLLM 0.23.0 and 0.25.1's (0.33.0 adds /cohere)


def authorized(path: str, header: str | None, key: str | None) -> bool:
    """vLLM's rule: without a key everything passes; with one, a guarded path needs ``Bearer KEY``
    (the scheme case-insensitive, the key exact)."""
    if not key or not path.startswith(GUARDED_PREFIX):
        return True
    scheme, _, param = (header or "").partition(" ")
    return scheme.lower() == "bearer" and param == key


def go_float(d: float) -> str:
    """A sample value as prometheus_client writes it (``utils.floatToGoString``)."""
    d = float(d)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class Engine:
    """What one vLLM engine's Prometheus counters do while it generates, speculating or not."""

    def __init__(self, model: str = "qwen", spec_tokens: int = 0, accepted: tuple[int, ...] = (1,)):
        if spec_tokens and any(a < 0 or a > spec_tokens for a in accepted):
            raise ValueError(f"accepted tokens per draft must lie in 0..{spec_tokens}: {accepted}")
        self.model, self.k, self.pattern = model, spec_tokens, tuple(accepted) or (0,)
        self.lock = threading.Lock()
        self.next = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * spec_tokens
        self.prompt_tokens = self.generation_tokens = 0
        self.created = time.time()

    def steps(self, n: int) -> list[tuple[int, int | None]]:
        """(tokens emitted, drafted tokens accepted) per engine step of an n-token completion: the
        prefill step gives one token and verifies no draft; then one token per step, or with
        speculation the accepted drafts plus the bonus token (the emission cut at n, the accepted
        count not: vLLM counts the verification before it applies max_tokens)."""
        out: list[tuple[int, int | None]] = [(1, None)] if n > 0 else []
        left = n - 1
        while left > 0:
            accepted = None
            if self.k:
                with self.lock:
                    accepted = self.pattern[self.next % len(self.pattern)]
                    self.next += 1
            out.append((min(1 if accepted is None else accepted + 1, left), accepted))
            left -= out[-1][0]
        return out

    def record(self, tokens: int, accepted: int | None, prompt_tokens: int = 0) -> None:
        """One engine step emitted ``tokens``; a verified draft (K tokens) had ``accepted`` right."""
        with self.lock:
            self.generation_tokens += tokens
            self.prompt_tokens += prompt_tokens
            if accepted is not None:
                self.drafts += 1
                self.draft_tokens += self.k
                self.accepted += accepted
                for i in range(accepted):
                    self.per_pos[i] += 1

    def run(self, n: int, prompt_tokens: int = 10):
        """Yield the tokens of each step of an n-token completion, recording the step's counters first."""
        for i, (tokens, accepted) in enumerate(self.steps(n)):
            self.record(tokens, accepted, prompt_tokens if i == 0 else 0)
            yield tokens

    def render(self) -> str:
        """The ``/metrics`` text vLLM serves for these counts (engine 0)."""
        labels = f'engine="0",model_name="{self.model}"'
        lines: list[str] = []

        def counter(name: str, doc: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"])
            lines.extend(f"{name}_total{{{lab}}} {go_float(v)}" for lab, v in samples)
            lines.extend([f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"])
            lines.extend(f"{name}_created{{{lab}}} {go_float(self.created)}" for lab, _ in samples)

        with self.lock:
            lines.extend(["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                          "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} 0.0"])
            if self.k:
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [(labels, self.drafts)])
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", [(labels, self.draft_tokens)])
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", [(labels, self.accepted)])
                counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                        [(f'{labels},position="{i}"', v) for i, v in enumerate(self.per_pos)])
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(labels, self.prompt_tokens)])
            counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    [(labels, self.generation_tokens)])
        return "\n".join(lines) + "\n"


class PromptLogprobs:
    """What vLLM's ``/v1/completions`` returns as prompt log-probabilities for the reference texts."""

    def __init__(self, artifact: str, side: str = "hybrid", noise: float = 0.0, corrupt: bool = False,
                 enabled: bool = True, legacy_echo: bool = False):
        from hybrid_build.validate.reference import read_reference

        self.ref = read_reference(artifact)
        self.side, self.noise, self.corrupt, self.enabled, self.legacy_echo = side, noise, corrupt, enabled, legacy_echo

    def _row(self, text, row: int, k: int, rng) -> dict:
        """One position: the top-k (noisy, re-ranked) plus the actual token with its rank."""
        src = (row + 7) % text.positions if self.corrupt else row
        ids = text.top_ids[self.side][src].tolist()[:k]
        lps = [lp + rng.gauss(0, self.noise) if self.noise else lp
               for lp in text.top_logprobs[self.side][src].tolist()[:k]]
        mass = sum(math.exp(v) for v in lps)
        if mass >= 1:  # noise must not give the top-k more than all the mass: vLLM's are a log_softmax
            lps = [v - math.log(mass) - 1e-6 for v in lps]
        order = sorted(range(len(ids)), key=lambda i: -lps[i])
        out = {str(ids[i]): {"logprob": lps[i], "rank": r + 1, "decoded_token": f"t{ids[i]}"}
               for r, i in enumerate(order)}
        actual = text.token_ids[row + 1]
        if str(actual) not in out:
            lp = float(text.target_logprob[self.side][row]) + (rng.gauss(0, self.noise) if self.noise else 0.0)
            out[str(actual)] = {"logprob": min(lp, min(lps) - 1e-3), "rank": k + 1, "decoded_token": f"t{actual}"}
        return out

    def answer(self, req: dict) -> dict | None:
        """The completion choice for ``req``, or None when its prompt is no reference text."""
        import random
        import zlib

        prompt = req.get("prompt")
        text = next((t for t in self.ref.texts.values() if t.token_ids == prompt), None)
        if text is None:
            return None
        k = None if self.legacy_echo else req.get("prompt_logprobs")
        if k is None and req.get("echo"):
            k = req.get("logprobs")  # what vLLM's CompletionRequest.to_sampling_params does
        rng = random.Random(zlib.crc32(text.name.encode()))  # the same noise in every run
        rows = [None] + [self._row(text, r, k, rng) for r in range(text.positions)] if k else None
        legacy = None
        if req.get("echo") and req.get("logprobs"):
            legacy = {"tokens": [f"t{i}" for i in prompt], "top_logprobs": [None] + [
                {v["decoded_token"]: v["logprob"] for v in row.values()} for row in (rows or [None])[1:] if row]}
        return {"index": 0, "text": "t0", "logprobs": legacy, "finish_reason": "length",
                "prompt_logprobs": rows if self.enabled else None, "prompt_token_ids": prompt}


class _Body:
    """A urlopen response: a context manager that reads or iterates its bytes."""

    def __init__(self, data: bytes = b"", lines=None):
        self.data, self.lines = data, lines

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self) -> bytes:
        return self.data

    def __iter__(self):
        return iter(self.lines if self.lines is not None else self.data.splitlines(keepends=True))


class FakeServer:
    """The stand-in in process, on a fake clock: ``first`` s to the first token, then one engine step
    every ``steps[k % len(steps)]`` s for the k-th chat request, so that runs differ by exactly
    what a test says. ``usage`` adds the usage chunk (and the running count in every chunk where the
    request asks for ``continuous_usage_stats``, as vLLM does); ``metrics`` serves ``/metrics``."""

    def __init__(self, clock: list[float], engine: Engine, tokens: int = 30, first: float | list = 0.3,
                 steps: float | list = 0.02, usage: bool = True, metrics: bool = True,
                 blank: tuple[int, int] = (0, 0), tool_parser: bool = True):
        self.clock, self.engine, self.tokens, self.usage, self.metrics = clock, engine, tokens, usage, metrics
        # without a tool-call parser vLLM refuses a request with tools (400, its words below)
        self.tool_parser = tool_parser
        # tokens lo <= i < hi stream with empty content, as vLLM streams tokens whose text its
        # detokenizer holds back (partial UTF-8) or that decode to nothing
        self.blank = blank
        self.first = first if isinstance(first, list) else [first]
        self.steps = steps if isinstance(steps, list) else [steps]
        self.requests: list[dict] = []

    def stream(self, body: dict):
        k = len(self.requests)
        self.requests.append(body)
        n = min(self.tokens, body.get("max_tokens") or self.tokens)
        first, gap = self.first[k % len(self.first)], self.steps[k % len(self.steps)]

        def lines():
            yield b": keep-alive\n"
            sent = 0
            for i, (tokens, accepted) in enumerate(self.engine.steps(n)):
                self.clock[0] += first if i == 0 else gap
                self.engine.record(tokens, accepted, 10 if i == 0 else 0)
                event = {"choices": [{"index": 0, "delta": {"content": "".join(
                    f"t{sent + j} " for j in range(tokens) if not self.blank[0] <= sent + j < self.blank[1])}}]}
                sent += tokens
                if self.usage and (body.get("stream_options") or {}).get("continuous_usage_stats"):
                    event["usage"] = {"completion_tokens": sent}  # vLLM: the running count in every chunk
                yield f"data: {json.dumps(event)}\n".encode()
                yield b"\n"
            if self.usage:
                yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n".encode()
            yield b"data: [DONE]\n"

        return _Body(lines=lines())


class FakeNetwork:
    """``urllib.request.urlopen`` for FakeServers by host:port; ``order`` logs the chat requests' hosts."""

    def __init__(self, servers: dict[str, FakeServer]):
        self.servers = servers
        self.order: list[str] = []

    def urlopen(self, req, timeout=None):
        import urllib.error
        from urllib.parse import urlsplit

        url = req if isinstance(req, str) else req.full_url
        parts = urlsplit(url)
        server = self.servers.get(parts.netloc)
        if server is None:
            raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
        if parts.path.endswith("/v1/models"):
            return _Body(json.dumps({"data": [{"id": server.engine.model}]}).encode())
        if parts.path == "/metrics":
            if not server.metrics:
                raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)
            return _Body(server.engine.render().encode())
        if parts.path.endswith("/v1/chat/completions"):
            self.order.append(parts.netloc)
            body = json.loads(req.data)
            if body.get("tools") and not server.tool_parser:
                import io
                msg = {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                            '--tool-call-parser to be set', "type": "BadRequestError", "code": 400}}
                raise urllib.error.HTTPError(url, 400, "Bad Request", {}, io.BytesIO(json.dumps(msg).encode()))
            return server.stream(body)
        raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)


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
    ap.add_argument("--spec-tokens", type=int, default=0, help="draft tokens per step (0: no speculation)")
    ap.add_argument("--accepted", default="1", help="accepted tokens per draft, a comma list used in turn")
    ap.add_argument("--no-metrics", action="store_true", help="/metrics answers 404 (not vLLM)")
    ap.add_argument("--reference", metavar="ARTIFACT", help="answer /v1/completions prompt log-probabilities "
                    "from this artifact's reference")
    ap.add_argument("--side", default="hybrid", help="the reference's side to answer with")
    ap.add_argument("--logprob-noise", type=float, default=0.0, help="N(0, X) on every log-probability")
    ap.add_argument("--corrupt", action="store_true", help="answer each position with another's distribution")
    ap.add_argument("--no-prompt-logprobs", action="store_true", help="prompt_logprobs null")
    ap.add_argument("--legacy-echo", action="store_true", help="only echo + logprobs gives prompt log-probabilities")
    a = ap.parse_args()
    scores = (PromptLogprobs(a.reference, a.side, a.logprob_noise, a.corrupt, not a.no_prompt_logprobs,
                             a.legacy_echo) if a.reference else None)
    engine = Engine(a.model, a.spec_tokens, tuple(int(x) for x in a.accepted.split(",") if x.strip()))
    api_key = os.environ.get("VLLM_API_KEY") or None
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

        def _refused(self) -> bool:
            """Answer 401 as vLLM does when the request lacks the key; True if it did."""
            if authorized(self.path, self.headers.get("Authorization"), api_key):
                return False
            self._json(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):
            if self._refused():
                return
            if self.path == "/metrics" and not a.no_metrics:
                body = engine.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path != "/v1/models":
                return self._json(404, {"error": "not found"})
            if time.monotonic() - START < a.ready_after or (a.ready_file and not os.path.exists(a.ready_file)):
                return self._json(503, {"error": "loading"})
            self._json(200, {"object": "list", "data": [{"id": a.model, "object": "model"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._refused():
                return
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                return self._json(404, {"error": "not found"})
            if req.get("model") != a.model:
                return self._json(404, {"error": f"model {req.get('model')!r} does not exist"})
            if self.path == "/v1/completions":
                choice = scores.answer(req) if scores else None
                if choice is None:
                    return self._json(400, {"error": "the stand-in answers only the reference texts (--reference)"})
                return self._json(200, {"id": "cmpl-standin", "object": "text_completion", "model": a.model,
                                        "choices": [choice], "usage": {"prompt_tokens": len(req["prompt"])}})
            if not req.get("stream"):
                message = {"role": "assistant", "content": a.answer}
                return self._json(200, {"choices": [{"index": 0, "message": message}],
                                        "usage": {"completion_tokens": 2}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(a.first_delay)
            n = min(a.tokens, req.get("max_tokens") or a.tokens)
            sent = 0
            for i, tokens in enumerate(engine.run(n)):
                if i:
                    time.sleep(a.token_delay)
                text = "".join(f"t{sent + j} " for j in range(tokens))
                sent += tokens
                ev = {"choices": [{"index": 0, "delta": {"content": text}}]}
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
