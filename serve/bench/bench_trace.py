"""``bench --trace``: multi-turn conversations replayed against a server, turn by turn.

For each conversation, in order, every assistant turn (up to ``max_turns``) is regenerated: the
history up to it is sent (the recorded one by default, so that every run and every server gets
the same prompts; with ``feed_back="generated"`` the server's own earlier replies take the place
of the recorded ones, the recorded tool results and user messages staying), streamed at
temperature 0, and timed. ``concurrency`` conversations run at once on one event loop, through
the project's one HTTP client (``core/http_client.AsyncHttpClient``). ``conversations`` picks
that many from the trace (a seeded sample, kept in the trace's order).

vLLM's ``/metrics`` counters (prefix cache, speculative decoding) are read before and after the
run, and for a soak at each window's end; they are server-wide. Each pass over the trace sends
its own ``cache_salt`` (vLLM keys its prefix cache by it; new for every run), so that a second
pass, a soak's next loop or a later run finds only what the pass itself cached: the hit rate stays
that of one run of the conversations, not of a resend.

**Before the replay** (``fit_check``): the server's ``max_model_len`` (vLLM lists it per model in
``/v1/models``) and each turn's prompt in tokens, counted by the server's own ``/tokenize`` (vLLM's,
with the request's messages, tools and chat template arguments: the count the request will get):
the turns whose prompt plus ``max_tokens`` the server would refuse are counted and said, with the
longest; ``skip_too_long`` leaves them out. A conversation's prompts only grow from turn to turn, so
its last turn is counted first and a binary search finds the first turn that does not fit. A
server without ``/tokenize`` is said to be unchecked.

**The soak** (``duration``): the conversations are looped until the time is up, ``concurrency`` at
once; no turn starts after the deadline and each request has its own deadline (``timeout``), so
the run ends by ``duration + timeout``. The turns are grouped into windows of ``window`` seconds
(by their start): requests, errors by kind, TTFT and decode tok/s p50/p95, hit rate, acceptance,
and the server's restarts (its ``process_start_time_seconds`` changed, or a counter went back)
or disappearance (``/metrics`` or a request found nothing answering).

Failures: a refused API key or a redirect stops the run (the user's to fix); any other failed
request is counted by kind, with the server's own words (``trace_report.failure_reason``), and the
run goes on; the caller exits 1 when any failed.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from hybrid_build.core.errors import ErrorStatus, ProtocolViolation, ServerUnreachable, UserError
from hybrid_build.core.http_client import AsyncHttpClient, metrics_url

from .bench import SPEC_ACCEPTED, SPEC_DRAFT_TOKENS, SPEC_DRAFTS
from .trace_formats import Conversation, Trace, message_chars, take_sample
from .trace_report import (
    Counters,
    Slo,
    ToolCheck,
    TurnResult,
    by_position,
    check_tool_calls,
    failure_reason,
    fit_line,
    summarize,
)

log = logging.getLogger(__name__)

REPORT_KIND = "hybrid-build bench trace"
SCHEMA_VERSION = 1
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
RESTART_GAUGE = "process_start_time_seconds"
# the KV cache's share in use (1 = full): vLLM's V1 name (0.23.0 to 0.34.0), and the V0 one before it
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
GENERATION_TOKENS = "vllm:generation_tokens"
TOKENIZE_AT_ONCE = 8  # /tokenize requests in flight while the turns are counted
# counters that only grow while one server process lives; one that goes back means a new process
MONOTONIC = (PREFIX_QUERIES, "vllm:prompt_tokens", "vllm:generation_tokens")


@dataclass
class ReplayOptions:
    concurrency: int = 1
    conversations: int | None = None
    max_turns: int | None = None
    max_tokens: int = 256
    feed_back: str = "recorded"        # or "generated"
    seed: int = 0
    thinking: bool = False
    timeout: float = 600.0             # one request's deadline
    duration: float | None = None      # a soak: loop the trace this long
    window: float = 60.0
    slo: Slo | None = None
    # the passes' cache_salt prefix: new each run, so that a run finds nothing an earlier one cached
    salt: str = field(default_factory=lambda: "hb-" + secrets.token_hex(4))
    tools: bool = True                 # send the conversations' tool definitions
    skip_too_long: bool = False        # leave out the turns longer than the server takes (``fit_check``)


def select(trace: Trace, n: int | None, seed: int) -> list[Conversation]:
    """``n`` conversations of the trace (all when None): a seeded sample in the trace's order, the
    one ``read_trace`` takes while reading a file (which then holds exactly those)."""
    convs = list(trace.conversations)
    if n is None or n >= len(convs):
        return convs
    return take_sample(convs, n, seed, trace.name)


def tools_to_send(conv: Conversation) -> list[dict]:
    """The trace's tool definitions, or, where it kept only names (a state.db), a definition per
    name without parameters: the server needs the names offered to parse a call."""
    if conv.tools:
        return list(conv.tools)
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in sorted(conv.tool_names)]


def request_body(model: str, conv: Conversation, history: list[dict], opts: ReplayOptions, salt: str) -> dict:
    body: dict = {"model": model, "messages": history, "max_tokens": opts.max_tokens, "temperature": 0,
                  "seed": opts.seed, "stream": True, "cache_salt": salt,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    tools = tools_to_send(conv) if opts.tools else []
    if tools:
        body["tools"] = tools
    if not opts.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def error_kind(e: Exception) -> str:
    """A failed request's kind, for the per-window error counts (never the server's words)."""
    if isinstance(e, ErrorStatus):
        return f"http {e.status}"
    if isinstance(e, ServerUnreachable):
        return "timeout" if "deadline" in str(e) or "within" in str(e) else "unreachable"
    if isinstance(e, ProtocolViolation):
        return "protocol"
    return type(e).__name__


@dataclass
class Server:
    """A server under test: its label, OpenAI base URL, model, client, the model's ``max_model_len``
    where ``/v1/models`` states it, and per conversation the turns that fit it (``fit_check``)."""
    label: str
    base_url: str
    model: str
    client: AsyncHttpClient = field(repr=False)
    max_model_len: int | None = None
    fits: dict[str, int] = field(default_factory=dict)


async def model_info(client: AsyncHttpClient, base_url: str, model: str | None = None) -> tuple[str, int | None]:
    """The model served (``model``, else the first listed) and its ``max_model_len`` where the list
    states it (vLLM does; None elsewhere)."""
    data = await client.get_json(base_url.rstrip("/") + "/models", timeout=30.0)
    try:
        cards = [c for c in data["data"] if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == model), None) if model else cards[0]
        name = model or card["id"]
    except (KeyError, IndexError, TypeError):
        raise ProtocolViolation(f"{base_url}/models answered no model list (not an OpenAI-compatible server?)")
    limit = (card or {}).get("max_model_len")
    return name, limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None



async def regenerate(server: Server, conv: Conversation, history: list[dict], turn: int, recorded: dict,
                     opts: ReplayOptions, salt: str, clock: Callable[[], float], t0: float
                     ) -> tuple[TurnResult, dict | None]:
    """One assistant turn regenerated: its result, and the reply as a message (None on failure)."""
    res = TurnResult(conv.id, turn, messages=len(history), prompt_chars=sum(message_chars(m) for m in history),
                     recorded_tool_call=bool(recorded.get("tool_calls")))
    body = request_body(server.model, conv, history, opts, salt)
    start = clock()
    res.start_s = start - t0
    first = last = None
    counted: list[tuple[float, int]] = []
    chunks, text, calls = 0, [], {}
    usage = None
    try:
        async for ev in server.client.stream_events(server.base_url + "/chat/completions", body, opts.timeout):
            now = clock()
            u = ev.get("usage")
            if u:
                usage = u
                n = u.get("completion_tokens")
                if ev.get("choices") and n and (not counted or n > counted[-1][1]):
                    counted.append((now, n))
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
                got = False
                for key in ("content", "reasoning_content", "reasoning"):
                    if delta.get(key):
                        got = True
                        if key == "content":
                            text.append(delta[key])
                for tc in delta.get("tool_calls") or []:
                    got = True
                    slot = calls.setdefault(tc.get("index", len(calls)), {"id": None, "name": "", "arguments": ""})
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                if got:
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except UserError:
        raise
    except (ServerUnreachable, ProtocolViolation, ErrorStatus) as e:
        res.error, res.end_s = error_kind(e), clock() - t0
        words = e.message if isinstance(e, ErrorStatus) else " ".join(str(e).split())
        res.reason = failure_reason(words, history)
        log.debug("%s turn %d: %s", conv.id, turn, res.error)
        return res, None
    end = clock()
    res.end_s, res.total_s = end - t0, end - start
    res.completion_tokens = (usage or {}).get("completion_tokens") or chunks
    res.prompt_tokens = (usage or {}).get("prompt_tokens")
    res.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if counted:
        (tf, nf), (tl, nl) = counted[0], counted[-1]
        res.ttft_s, res.decode_s, res.decode_tokens, res.steps = tf - start, tl - tf, nl - nf, len(counted) - 1
    elif first is not None:
        res.ttft_s, res.decode_s = first - start, last - first
        res.decode_tokens, res.steps = max(res.completion_tokens - 1, 0), max(chunks - 1, 0)
    tool_calls = [{"id": c["id"] or f"call_{conv.id}_{turn}_{i}", "type": "function",
                   "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in sorted(calls.items())]
    res.tool = check_tool_calls(tool_calls, conv.tool_names) if tool_calls else ToolCheck(calls=0)
    reply: dict = {"role": "assistant", "content": "".join(text) or None}
    if tool_calls:
        # the recorded tool results answer the recorded calls' ids: the generated calls take them
        ids = [c.get("id") for c in recorded.get("tool_calls") or []]
        for i, c in enumerate(tool_calls):
            if i < len(ids) and ids[i]:
                c["id"] = ids[i]
        reply["tool_calls"] = tool_calls
    if reply["content"] is None and not tool_calls:
        reply["content"] = ""
    return res, reply


async def play(server: Server, conv: Conversation, opts: ReplayOptions, salt: str, clock, t0: float,
               loop: int, deadline: float | None, out: list[TurnResult], on_turn=None) -> None:
    """One conversation's turns in order; a soak stops before a turn that would start after ``deadline``."""
    idx = conv.assistant_turns[:opts.max_turns] if opts.max_turns else conv.assistant_turns
    if opts.skip_too_long and conv.id in server.fits:
        idx = idx[:server.fits[conv.id]]
    generated: dict[int, dict] = {}
    for pos, i in enumerate(idx, 1):
        if deadline is not None and clock() >= deadline:
            return
        history = [generated.get(j, m) for j, m in enumerate(conv.messages[:i])]
        res, reply = await regenerate(server, conv, history, pos, conv.messages[i], opts, salt, clock, t0)
        res.loop = loop
        out.append(res)
        if on_turn:  # a progress callback, or a coroutine function (the soak's windows)
            got = on_turn(res)
            if asyncio.iscoroutine(got):
                await got
        if opts.feed_back == "generated" and reply is not None:
            generated[i] = reply


class _NoTokenize(Exception):
    """The server has no ``/tokenize`` (or answers it in another protocol): the turns go uncounted."""


async def _count(server: Server, conv: Conversation, history: list[dict], opts: ReplayOptions, url: str) -> int:
    """The prompt tokens of ``history`` as the server's ``/tokenize`` counts a chat request."""
    body: dict = {"model": server.model, "messages": history, "add_generation_prompt": True}
    tools = tools_to_send(conv) if opts.tools else []
    if tools:
        body["tools"] = tools
    if not opts.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        data = await server.client.post_json(url, body, timeout=opts.timeout)
    except ErrorStatus as e:
        if e.status in (404, 405):
            raise _NoTokenize(f"no {url}") from None
        raise
    except ProtocolViolation as e:
        raise _NoTokenize(str(e)) from None
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise _NoTokenize(f"{url} answered no token count")
    return count


async def fit_check(server: Server, convs: list[Conversation], opts: ReplayOptions) -> dict:
    """The turns whose prompt plus ``max_tokens`` is longer than the server's ``max_model_len`` (vLLM
    refuses them: ``renderers/params.py``, prompt tokens > max_model_len - max_tokens), counted with
    the server's ``/tokenize`` before the replay; ``server.fits`` gets the turns that fit per
    conversation (a conversation's prompts only grow: the last turn first, then a binary search)."""
    limit = server.max_model_len
    out: dict = {"max_model_len": limit, "max_tokens": opts.max_tokens, "counted_by": None, "why": None,
                 "turns": 0, "too_long": 0, "longest": None, "skipped": 0}
    if not limit:
        out["why"] = "no max_model_len in /v1/models"
        return out
    url = metrics_url(server.base_url)[:-len("/metrics")] + "/tokenize"
    room = limit - opts.max_tokens
    gate = asyncio.Semaphore(TOKENIZE_AT_ONCE)
    last_turn: dict[str, tuple[int, int]] = {}  # conversation -> (its last turn's prompt tokens, that turn)

    async def one(conv: Conversation) -> None:
        idx = conv.assistant_turns[:opts.max_turns] if opts.max_turns else conv.assistant_turns

        async def count(k: int) -> int:
            async with gate:
                return await _count(server, conv, list(conv.messages[:idx[k]]), opts, url)

        last = await count(len(idx) - 1)
        last_turn[conv.id] = (last, len(idx))
        fits = len(idx)
        if last > room:
            lo, hi = 0, len(idx) - 1  # the first turn that does not fit lies in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                if await count(mid) > room:
                    hi = mid
                else:
                    lo = mid + 1
            fits = lo
        server.fits[conv.id] = fits
        out["turns"] += len(idx)
        out["too_long"] += len(idx) - fits

    try:
        await _gather([one(c) for c in convs])
    except _NoTokenize as e:
        server.fits.clear()
        out.update(turns=0, too_long=0, why=f"the server counts no tokens: {e}")
        return out
    except (ServerUnreachable, ErrorStatus) as e:
        server.fits.clear()
        out.update(turns=0, too_long=0, why=f"/tokenize failed: {' '.join(str(e).split())[:160]}")
        return out
    cid = max((c.id for c in convs), key=lambda i: last_turn[i][0])  # the first in the trace's order on a tie
    tokens, turn = last_turn[cid]
    out.update(counted_by="/tokenize", longest={"tokens": tokens, "conversation": cid, "turn": turn},
               skipped=out["too_long"] if opts.skip_too_long else 0)
    return out


async def _fit(server: Server, convs: list[Conversation], opts: ReplayOptions, on_note, prefix: str = "") -> dict:
    """``fit_check``, said through ``on_note`` before the replay where a turn does not fit the server's
    stated max_model_len, or none could be counted against it."""
    fit = await fit_check(server, convs, opts)
    if on_note and fit["max_model_len"] and (fit["too_long"] or not fit["counted_by"]):
        on_note(prefix + fit_line(fit))
    if opts.skip_too_long and fit["counted_by"] and fit["too_long"] == fit["turns"]:
        raise UserError(f"{prefix}every turn is longer than the server's max_model_len {fit['max_model_len']:,} takes "
                        f"(prompt + {opts.max_tokens} completion tokens): nothing to replay")
    return fit


async def read_counters(server: Server) -> dict | None:
    """The counters this replay reads (None: no /metrics; ``{"gone": True}``: nothing answers)."""
    try:
        m = await server.client.metrics(metrics_url(server.base_url), timeout=30.0)
    except (ServerUnreachable, ErrorStatus):
        return {"gone": True}
    except ProtocolViolation:
        return None
    if m is None:
        return None
    start = m.samples(RESTART_GAUGE)
    usage = next((found for name in KV_USAGE if (found := m.samples(name))), [])
    return {"gone": False, "start": start[0][1] if start else None,
            "kv_usage": max(v for _, v in usage) if usage else None,
            **{n: m.counter(n) for n in (PREFIX_QUERIES, PREFIX_HITS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED,
                                         *MONOTONIC)}}


def restarted(before: dict | None, after: dict | None) -> bool:
    """Whether the server process changed between two readings: a new start time, or a counter
    that only grows went back."""
    if not before or not after or before.get("gone") or after.get("gone"):
        return False
    if before.get("start") is not None and after.get("start") is not None and after["start"] != before["start"]:
        return True
    return any(before.get(n) is not None and after.get(n) is not None and after[n] < before[n] for n in MONOTONIC)


def delta(before: dict | None, after: dict | None) -> Counters | None:
    if not before or not after or before.get("gone") or after.get("gone") or restarted(before, after):
        return None

    def d(n):
        return after[n] - before[n] if after.get(n) is not None and before.get(n) is not None else None

    return Counters(d(PREFIX_QUERIES), d(PREFIX_HITS), d(SPEC_DRAFTS), d(SPEC_DRAFT_TOKENS), d(SPEC_ACCEPTED))


async def run_pass(server: Server, convs: list[Conversation], opts: ReplayOptions, salt: str,
                   clock=time.perf_counter, on_turn=None) -> tuple[list[TurnResult], float, Counters | None]:
    """One pass over the conversations, ``concurrency`` at once: the turns, the wall time and the
    counters' deltas."""
    before = await read_counters(server)
    out: list[TurnResult] = []
    queue = list(convs)
    t0 = clock()

    async def worker():
        while queue:
            conv = queue.pop(0)
            await play(server, conv, opts, salt, clock, t0, 0, None, out, on_turn)

    await _gather([worker() for _ in range(min(opts.concurrency, len(convs)))])
    wall = clock() - t0
    after = await read_counters(server)
    return out, wall, delta(before, after)


async def _gather(coros) -> None:
    """Run the coroutines; the first exception cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def report(server: Server, trace: Trace, convs: list[Conversation], opts: ReplayOptions,
           turns: list[TurnResult], wall: float, counters: Counters | None, synthetic: dict | None,
           fit: dict | None = None) -> dict:
    overall = summarize(turns, wall, opts.slo, counters or Counters())
    warnings = []
    if counters is None:
        warnings.append("no counter deltas (no /metrics, or the server restarted during the run): hit rate and "
                        "acceptance from the usage and the stream only")
    if any(c.tool_names_from == "recorded" for c in convs):
        warnings.append("some conversations carry no tool definitions: the names their recorded calls used were "
                        "sent as tools without parameters")
    return {"kind": REPORT_KIND, "schema_version": SCHEMA_VERSION, "base_url": server.base_url,
            "model": server.model, "trace": {"format": trace.format, "name": trace.name,
                                             "conversations_in_trace": trace.total},
            "conversations": len(convs), "concurrency": opts.concurrency, "max_turns": opts.max_turns,
            "max_tokens": opts.max_tokens, "feed_back": opts.feed_back, "seed": opts.seed, "wall_s": wall,
            "overall": overall, "per_position": by_position(turns, wall, opts.slo),
            "synthetic": synthetic, "fit": fit, "warnings": warnings, "turns": [t.to_json() for t in turns]}


async def _servers(urls: list[str], model: str | None, api_key: str | None, opts: ReplayOptions,
                   stack) -> list[Server]:
    out = []
    for label, url in zip("AB", urls):
        client = await stack.enter_async_context(AsyncHttpClient(api_key=api_key, timeout=opts.timeout,
                                                                 connections=max(opts.concurrency, 4) + 2))
        name, limit = await model_info(client, url, model)
        out.append(Server(label, url, name, client, limit))
    return out


def replay(url: str, trace: Trace, opts: ReplayOptions, model: str | None = None, api_key: str | None = None,
           synthetic: dict | None = None, on_turn=None, on_note=None) -> dict:
    """One server, one pass over the trace: the report. ``on_note`` hears what the check before the
    replay found (``fit_check``), before the first request."""
    from contextlib import AsyncExitStack

    convs = select(trace, opts.conversations, opts.seed)

    async def main():
        async with AsyncExitStack() as stack:
            (server,) = await _servers([url], model, api_key, opts, stack)
            fit = await _fit(server, convs, opts, on_note)
            turns, wall, counters = await run_pass(server, convs, opts, f"{opts.salt}-{opts.seed}-1", on_turn=on_turn)
            return report(server, trace, convs, opts, turns, wall, counters, synthetic, fit)

    return asyncio.run(main())


# ---- A/B -----------------------------------------------------------------------------------------

PASS_METRICS = (("ttft_p50_s", "TTFT p50 ms", False, 1000.0), ("decode_tok_s", "decode tok/s", True, 1.0),
                ("e2e_tok_s", "e2e tok/s", True, 1.0))


def _pass_sample(turns: list[TurnResult], wall: float) -> dict:
    s = summarize(turns, wall)
    return {"ttft_p50_s": s["ttft_s"]["p50"], "decode_tok_s": s["decode_tok_s"]["aggregate"],
            "e2e_tok_s": s["e2e_tok_s"]["aggregate"], "errors": sum(s["errors"].values())}


def replay_pair(url_a: str, url_b: str, trace: Trace, opts: ReplayOptions, runs: int, model: str | None = None,
                api_key: str | None = None, synthetic: dict | None = None, on_turn=None, on_note=None) -> dict:
    """Two servers, ``runs`` passes each, interleaved A, B, A, B (each pass its own cache salt, the
    same on both sides); per pass the TTFT p50 and the aggregate tok/s; a verdict per figure only
    where the passes' ranges do not overlap (``bench.verdict``)."""
    from contextlib import AsyncExitStack

    from .bench import verdict

    convs = select(trace, opts.conversations, opts.seed)

    async def main():
        async with AsyncExitStack() as stack:
            servers = await _servers([url_a, url_b], model, api_key, opts, stack)
            fits = {s.label: await _fit(s, convs, opts, on_note, f"{s.label}: ") for s in servers}
            turns: dict[str, list] = {"A": [], "B": []}
            passes: dict[str, list] = {"A": [], "B": []}
            counters: dict[str, list] = {"A": [], "B": []}
            walls = {"A": 0.0, "B": 0.0}
            for i in range(1, runs + 1):
                for s in servers:
                    got, wall, c = await run_pass(s, convs, opts, f"{opts.salt}-{opts.seed}-{i}", on_turn=on_turn)
                    turns[s.label] += got
                    passes[s.label].append(_pass_sample(got, wall))
                    counters[s.label].append(c)
                    walls[s.label] += wall
            reports = {}
            for s in servers:
                cs = counters[s.label]
                total = None if any(c is None for c in cs) else Counters(
                    *(sum((getattr(c, f) or 0) for c in cs) if any(getattr(c, f) is not None for c in cs) else None
                      for f in ("prefix_queries", "prefix_hits", "drafts", "draft_tokens", "accepted_tokens")))
                reports[s.label] = report(s, trace, convs, opts, turns[s.label], walls[s.label], total, synthetic,
                                          fits[s.label])
                reports[s.label]["passes"] = passes[s.label]
            rows = []
            for key, label, higher, factor in PASS_METRICS:
                a = [p[key] for p in passes["A"] if p[key] is not None]
                b = [p[key] for p in passes["B"] if p[key] is not None]
                text, significant = verdict(a, b, higher) if a and b else ("no data", False)
                rows.append({"metric": key, "label": label, "factor": factor, "a": a, "b": b, "verdict": text,
                             "significant": significant})
            return {"kind": REPORT_KIND + " comparison", "schema_version": SCHEMA_VERSION, "runs": runs,
                    "interleaved": True, "metrics": rows, "reports": reports}

    return asyncio.run(main())


def pair_table(comparison: dict) -> str:
    from .trace_report import table

    a, b = comparison["reports"]["A"], comparison["reports"]["B"]
    lines = [f"A: {a['model']} at {a['base_url']}", f"B: {b['model']} at {b['base_url']}",
             f"{comparison['runs']} passes over the trace each, interleaved (A, B, A, B...), each pass its own "
             f"cache salt; a verdict only where the passes' ranges do not overlap", ""]
    def rng(v: list, f: float) -> str:
        return f"{min(v) * f:.1f}-{max(v) * f:.1f}" if v else "-"

    for m in comparison["metrics"]:
        lines.append(f"{m['label']:<14} A {rng(m['a'], m['factor']):<16} B {rng(m['b'], m['factor']):<16} "
                     f"{m['verdict']}")
    lines += ["", "A:", table(a), "", "B:", table(b)]
    return "\n".join(lines)
