"""Single-stream speed of any OpenAI-compatible server: decode-only and end-to-end tokens/s.

Each prompt runs ``runs + 1`` times at temperature 0; the first run warms caches and is
discarded. Decode tok/s = (completion tokens - 1) / (last token time - first token time), so it
excludes the time to first token; end-to-end tok/s = completion tokens / wall time of the request.
Token counts come from the stream's ``usage`` (``stream_options.include_usage``), else from the
number of content chunks.
"""
from __future__ import annotations

import json
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass

PROMPTS = {
    "prose": "Write a short paragraph about the history of tea.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "tool-call": "Call the get_weather tool for Paris in celsius.",
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]


@dataclass
class RunTiming:
    tokens: int
    ttft_s: float
    total_s: float
    decode_s: float


@dataclass
class PromptResult:
    prompt: str
    runs: int
    tokens: float
    ttft_s: float
    decode_tok_s: float
    e2e_tok_s: float


def first_model(base_url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=timeout) as r:
        data = json.loads(r.read().decode())
    return data["data"][0]["id"]


def stream_once(base_url: str, model: str, kind: str, max_tokens: int, timeout: float = 600.0) -> RunTiming:
    body: dict = {"model": model, "messages": [{"role": "user", "content": PROMPTS[kind]}],
                  "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if kind == "tool-call":
        body["tools"] = TOOLS
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                        or delta.get("tool_calls"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
    t_end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    if first is None:
        first = last = t_end
    return RunTiming(tokens, first - t0, t_end - t0, (last or t_end) - first)


def bench(base_url: str, model: str | None = None, runs: int = 5, max_tokens: int = 256,
          prompts: list[str] | None = None) -> dict:
    model = model or first_model(base_url)
    results = []
    for kind in prompts or list(PROMPTS):
        timings = [stream_once(base_url, model, kind, max_tokens) for _ in range(runs + 1)][1:]
        decode = [(t.tokens - 1) / t.decode_s for t in timings if t.tokens > 1 and t.decode_s > 0]
        results.append(PromptResult(
            prompt=kind, runs=len(timings), tokens=statistics.mean(t.tokens for t in timings),
            ttft_s=statistics.mean(t.ttft_s for t in timings),
            decode_tok_s=statistics.mean(decode) if decode else 0.0,
            e2e_tok_s=statistics.mean(t.tokens / t.total_s for t in timings)))
    return {"base_url": base_url, "model": model, "runs": runs, "max_tokens": max_tokens, "temperature": 0,
            "results": [asdict(r) for r in results]}


def table(report: dict) -> str:
    lines = [f"{report['model']} at {report['base_url']} ({report['runs']} runs each, first discarded, temperature 0)",
             f"{'prompt':<10} {'tokens':>7} {'TTFT s':>7} {'decode tok/s':>13} {'e2e tok/s':>10}"]
    for r in report["results"]:
        lines.append(f"{r['prompt']:<10} {r['tokens']:>7.0f} {r['ttft_s']:>7.3f} {r['decode_tok_s']:>13.1f} "
                     f"{r['e2e_tok_s']:>10.1f}")
    return "\n".join(lines)
