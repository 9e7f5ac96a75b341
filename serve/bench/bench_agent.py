"""``bench --agent``: time to first token for agents, whose every turn resends a long conversation.

An agent's turn is a long prefix its previous turn already sent (system prompt, tools, history: tens
of thousands of tokens) plus a short new turn. Where the server caches prefixes it computes only the
new turn, so the time to first token (TTFT) stays nearly flat as the context grows; without a cache
it grows with the context. Per context length (``contexts``, default 8k / 32k / 64k tokens, k = 1024):

- **the prefix**: a session line of its own (no other conversation shares its first block) and
  agent-like history (test-run lines) as the system message, sized by the server's own token counts:
  two short calibration requests give ``usage.prompt_tokens`` at two sizes, hence tokens per line;
- **cold**: the prefix + turn A, the first time this session is sent: nothing of it is cached;
- **warm**: the same prefix + turn B, the next turn: its prefix is cached where the server caches.

TTFT is the time from sending the request to its first streamed token (chunks with content, or the
server's running token count where it sends one, as ``bench``). Around each request the server's
prefix-cache counters (vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, tokens)
give its hit rate: hit tokens / tokens looked up. The counters are server-wide: other traffic
counts too. Per context: median and range over ``runs`` of cold TTFT, warm TTFT, cold / warm and the
warm hit rate, after one discarded warm-up run. With ``concurrency`` N: N sessions at once (a main
agent and its subagents), a cold round then a warm round, each stream's TTFT its own; the hit rate
is the round's.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from hybrid_build.core import limits
from hybrid_build.core.errors import ExternalToolError, UserError
from hybrid_build.validate.verify.verify_paths import PREFIX_HITS, PREFIX_QUERIES

from .bench import _stats, at_once, chat_events, client, first_model, read_metrics

AGENT_KIND = "hybrid-build bench agent"
SCHEMA_VERSION = 1
CONTEXTS = (8 * 1024, 32 * 1024, 64 * 1024)
MAX_TOKENS = 8  # TTFT needs the first token; a few more show the stream goes on
CALIBRATION_LINES = (16, 64)
_HEAD = "You are a coding agent working in a Python repository. Session {session}. The history so far:"
_LINE = "[{i:05d}] tests/test_module_{m:02d}.py::test_case_{i} PASSED"
TURNS = ("The test run above has finished. Answer in one word: did every test pass?",
         "Now look at the test run above again. Answer in one word: was any test skipped?")


def parse_contexts(text: str) -> list[int]:
    """``8k,32k,64k`` (k = 1024) or token counts; a bad list is a ``UserError``."""
    out = []
    for item in (s.strip().lower() for s in text.split(",")):
        m = re.fullmatch(r"(\d+)(k?)", item)
        if not m or int(m.group(1)) == 0:
            raise UserError(f"--contexts {text}: give token counts such as 8k,32k,64k (k = 1024) or 8192")
        digits = m.group(1).lstrip("0")
        tokens = int(digits) * (1024 if m.group(2) else 1) if len(digits) <= 9 else limits.MAX_TOKENS + 1
        if tokens > limits.MAX_TOKENS:
            raise UserError(f"--contexts {text}: {item} is more than {limits.MAX_TOKENS:,} tokens, past any served "
                            "model's max_model_len")
        out.append(tokens)
    return out


def messages(session: str, lines: int, turn: str) -> list[dict]:
    history = "\n".join(_LINE.format(i=i, m=i % 97) for i in range(lines))
    return [{"role": "system", "content": _HEAD.format(session=session) + "\n" + history},
            {"role": "user", "content": turn}]


def _first_token(event: dict) -> bool:
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
    count = usage.get("completion_tokens")
    if event.get("choices") and isinstance(count, (int, float)) and count >= 1:
        return True
    choices = event.get("choices") if isinstance(event.get("choices"), list) else []
    return any(isinstance(c, dict) and isinstance(c.get("delta"), dict) and c["delta"].get(k)
               for c in choices for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


def ttft_once(base_url: str, model: str, msgs: list[dict], api_key: str | None,
              timeout: float = 600.0) -> tuple[float, int | None]:
    """One streamed chat completion: (seconds to its first token, its prompt tokens per the server)."""
    body = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    t0 = time.perf_counter()
    first = prompt_tokens = None
    for event in chat_events(base_url, body, api_key, timeout):
        if first is None and _first_token(event):
            first = time.perf_counter()
        usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    if first is None:
        raise ExternalToolError(f"{base_url}: a chat completion streamed no token (max_tokens {MAX_TOKENS})")
    return first - t0, prompt_tokens


def prefix_counts(base_url: str, api_key: str | None) -> tuple[float, float] | None:
    """(tokens looked up, tokens hit) in the server's prefix cache; None without those counters."""
    m = read_metrics(base_url, 30.0, api_key)
    if m is None:
        return None
    q, h = m.counter(PREFIX_QUERIES), m.counter(PREFIX_HITS)
    return None if q is None or h is None else (q, h)


@dataclass
class Turn:
    """One measured request: TTFT, the prompt's tokens, and its (round's) prefix-cache counter deltas."""
    stream: int
    ttft_s: float
    prompt_tokens: int | None
    queried_tokens: float | None = None
    hit_tokens: float | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


class Session:
    """One agent's conversation: its own session line and the lines that give it ``tokens``."""

    def __init__(self, lines: int):
        self.id, self.lines = uuid.uuid4().hex[:12], lines

    def turn(self, i: int) -> list[dict]:
        return messages(self.id, self.lines, TURNS[i])


def calibrate(base_url: str, model: str, api_key: str | None) -> tuple[float, float]:
    """(tokens per history line, tokens of everything else), from the server's prompt token counts of
    two short prompts (each its own session)."""
    counts = []
    for lines in CALIBRATION_LINES:
        _, tokens = ttft_once(base_url, model, messages(uuid.uuid4().hex[:12], lines, TURNS[0]), api_key)
        if not tokens:
            raise ExternalToolError(f"{base_url}: the server reports no usage.prompt_tokens: bench --agent sizes "
                                    "its contexts from them")
        counts.append(tokens)
    per_line = (counts[1] - counts[0]) / (CALIBRATION_LINES[1] - CALIBRATION_LINES[0])
    if per_line <= 0:
        raise ExternalToolError(f"{base_url}: prompt token counts {counts} do not grow with the prompt")
    return per_line, counts[0] - per_line * CALIBRATION_LINES[0]


def lines_for(tokens: int, per_line: float, rest: float) -> int:
    return max(1, round((tokens - rest) / per_line))


def _round(base_url: str, model: str, sessions: list[Session], turn: int, api_key: str | None) -> list[Turn]:
    """Every session's turn at once, the counters read around them."""
    before = prefix_counts(base_url, api_key)
    got = at_once([lambda s=s: ttft_once(base_url, model, s.turn(turn), api_key) for s in sessions])
    after = prefix_counts(base_url, api_key) if before is not None else None
    q = h = None
    if before is not None and after is not None:
        q, h = after[0] - before[0], after[1] - before[1]
    return [Turn(i + 1, ttft, tokens, q, h) for i, (ttft, tokens) in enumerate(got)]


def measure_context(base_url: str, model: str, tokens: int, lines: int, runs: int, concurrency: int,
                    api_key: str | None, on_run: Callable | None = None, warm_up: bool = False) -> dict:
    """Cold and warm TTFT at one context length: ``runs`` runs (one more, discarded, with ``warm_up``)."""
    cold: list[list[Turn]] = []
    warm: list[list[Turn]] = []
    for i in range(runs + (1 if warm_up else 0)):
        sessions = [Session(lines) for _ in range(concurrency)]
        c = _round(base_url, model, sessions, 0, api_key)
        w = _round(base_url, model, sessions, 1, api_key)
        if warm_up and i == 0:
            continue
        cold.append(c)
        warm.append(w)
        if on_run:
            on_run(tokens, i)
    return summarize_context(tokens, lines, cold, warm)


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize_context(tokens: int, lines: int, cold: list[list[Turn]], warm: list[list[Turn]]) -> dict:
    flat_c, flat_w = [t for r in cold for t in r], [t for r in warm for t in r]
    st = {"cold_ttft_s": _stats(t.ttft_s for t in flat_c), "warm_ttft_s": _stats(t.ttft_s for t in flat_w),
          "prompt_tokens": _stats(t.prompt_tokens for t in flat_w),
          "warm_queried_tokens": _stats(r[0].queried_tokens for r in warm),
          "warm_hit_rate": _stats(r[0].hit_rate for r in warm), "cold_hit_rate": _stats(r[0].hit_rate for r in cold)}
    out = {"context": tokens, "history_lines": lines, "runs": len(cold)}
    for k, s in st.items():
        out[k] = s["median"] if s else None
    out["spread"] = {k: [s["min"], s["max"]] if s else None for k, s in st.items()}
    out["cold_over_warm"] = _ratio(out["cold_ttft_s"], out["warm_ttft_s"])
    streams = max((len(r) for r in cold), default=0)
    if streams > 1:
        out["streams"] = []
        for n in range(1, streams + 1):
            c = _stats(t.ttft_s for t in flat_c if t.stream == n)
            w = _stats(t.ttft_s for t in flat_w if t.stream == n)
            out["streams"].append({"stream": n, "cold_ttft_s": c["median"] if c else None,
                                   "warm_ttft_s": w["median"] if w else None,
                                   "cold_over_warm": _ratio(c and c["median"], w and w["median"]),
                                   "spread": {"cold_ttft_s": [c["min"], c["max"]] if c else None,
                                              "warm_ttft_s": [w["min"], w["max"]] if w else None}})
    out["samples"] = {"cold": [[asdict(t) for t in r] for r in cold], "warm": [[asdict(t) for t in r] for r in warm]}
    return out


def bench_agent(base_url: str, model: str | None = None, contexts: list[int] | None = None, runs: int = 3,
                concurrency: int = 1, api_key: str | None = None, on_run: Callable | None = None) -> dict:
    """The agent TTFT report of one server."""
    model = model or first_model(base_url, api_key=api_key)
    contexts = list(contexts or CONTEXTS)
    limit = _max_model_len(base_url, model, api_key)
    too_long = [c for c in contexts if limit and c + MAX_TOKENS > limit]
    if too_long:
        raise UserError(f"--contexts {','.join(map(str, too_long))}: longer than the server's max_model_len "
                        f"{limit} (with {MAX_TOKENS} tokens to generate)")
    per_line, rest = calibrate(base_url, model, api_key)
    results = [measure_context(base_url, model, c, lines_for(c, per_line, rest), runs, concurrency, api_key, on_run,
                               warm_up=(i == 0)) for i, c in enumerate(contexts)]
    warnings = []
    for r in results:
        if r["warm_queried_tokens"] is None:
            warnings.append(f"{r['context']} tokens: no prefix-cache counters on /metrics: the hit rate is unknown")
        elif r["warm_queried_tokens"] == 0:
            warnings.append(f"{r['context']} tokens: the server looked nothing up in a prefix cache (caching off): "
                            "warm TTFT is a cold one")
        elif r["warm_hit_rate"] == 0:
            warnings.append(f"{r['context']} tokens: the warm turns hit nothing in the prefix cache (caching off, or "
                            "a drafter or runtime that disables it): warm TTFT is a cold one")
    return {"kind": AGENT_KIND, "schema_version": SCHEMA_VERSION, "base_url": base_url, "model": model,
            "runs": runs, "concurrency": concurrency, "max_tokens": MAX_TOKENS,
            "calibration": {"tokens_per_line": per_line, "other_tokens": rest}, "results": results,
            "warnings": warnings}


def _max_model_len(base_url: str, model: str, api_key: str | None) -> int | None:
    data = client(api_key).get_json(base_url.rstrip("/") + "/models", 30.0)
    listed = data.get("data") if isinstance(data, dict) else None
    entry = next((m for m in listed if isinstance(m, dict) and m.get("id") == model), {}) \
        if isinstance(listed, list) else {}
    v = entry.get("max_model_len")
    return v if isinstance(v, int) and v > 0 else None


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def agent_table(report: dict) -> str:
    lines = [f"agent TTFT: {report['model']} at {report['base_url']}, {report['runs']} runs per context, "
             f"{report['concurrency']} stream(s); warm = the same prefix + a new turn",
             f"{'context':>8} {'prompt tok':>10} {'cold TTFT s':>12} {'warm TTFT s':>12} {'cold/warm':>9} "
             f"{'warm hit rate':>13}"]
    for r in report["results"]:
        ratio = "-" if r["cold_over_warm"] is None else f"{r['cold_over_warm']:.1f}x"
        hit = "-" if r["warm_hit_rate"] is None else f"{r['warm_hit_rate']:.1%}"
        tokens = "-" if r["prompt_tokens"] is None else f"{r['prompt_tokens']:.0f}"
        lines.append(f"{r['context']:>8} {tokens:>10} {_s(r['cold_ttft_s']):>12} {_s(r['warm_ttft_s']):>12} "
                     f"{ratio:>9} {hit:>13}")
        for s in r.get("streams", []):
            ratio = "-" if s["cold_over_warm"] is None else f"{s['cold_over_warm']:.1f}x"
            lines.append(f"{'stream ' + str(s['stream']):>19} {_s(s['cold_ttft_s']):>12} {_s(s['warm_ttft_s']):>12} "
                         f"{ratio:>9}")
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)
