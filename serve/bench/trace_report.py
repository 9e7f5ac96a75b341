"""The figures of a trace replay, from the turns it measured: overall and per turn position.

Per turn (one regenerated assistant turn): TTFT, decode tok/s (tokens after the first over the
time from the first to the last token), end-to-end tok/s (completion tokens over the request's
wall time, prefill included), TPOT (the inverse of decode tok/s), its prompt and cached tokens
(``usage.prompt_tokens_details.cached_tokens`` where the server gives it) and engine steps.
Percentiles are nearest-rank (the smallest value with at least p% of the values at or below it).
Aggregates: tok/s summed over turns (tokens over seconds, so a long turn weighs more), the
prefix-cache hit rate as hit tokens over queried tokens (vLLM's ``prefix_cache_hits``/``queries``
counters around the run, or the usage's cached over prompt tokens), the draft acceptance from
vLLM's spec-decode counters around the run, and per position the decode tokens per engine step
(vLLM streams one chunk per step: accepted drafts plus the bonus token).

**Tool-call validity**: an answer's ``tool_calls`` are valid when every call parses (a function
name and arguments assembled from the stream), names a tool the conversation offered, and carries
arguments that are a JSON object. **Goodput**: the turns within ``--slo ttft=S,tpot=S`` (both
where both are given), as a share of all turns and per second of the run.

**Why a request failed**: its kind (``http 400``, ``timeout``, ``unreachable``...) and the server's own
words (``failure_reason``: the message of its JSON error body, without terminal control characters,
cut before anything that quotes the request, at most ``REASON_CHARS``; withheld whole where it still
quotes the request's text), grouped by kind and by the words with their numbers as ``N``.

No message text enters a report: conversation ids, turn positions, lengths, figures and the server's
words about a failure only.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

from hybrid_build.core.bounded_read import depth_over
from hybrid_build.core.terminal_text import printable

# turn positions are grouped: 1, 2, 3, 4, 5-8, 9-16, 17-32, 33+
POSITION_BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 8), (9, 16), (17, 32), (33, None))
REASON_CHARS = 240  # of a server's words about one failure
REASON_GROUPS = 10  # reasons listed, most frequent first
# where a server's message starts quoting the request (pydantic's ``input_value=``, a validation
# error's ``'input': ...``): the words before it are kept, the rest never
_QUOTES_INPUT = re.compile(r"input_value\s*=|['\"]input['\"]\s*:|\binput\s*=", re.I)
_NUMBER = re.compile(r"\d[\d,._]*")
WITHHELD = "(the server's words quote the request: not shown)"


def _request_text(sent: list[dict]) -> str:
    parts = []
    for m in sent:
        c = m.get("content")
        parts += [c] if isinstance(c, str) else [p.get("text") or "" for p in c or [] if isinstance(p, dict)]
        parts += [(t.get("function") or {}).get("arguments") or "" for t in m.get("tool_calls") or []]
    return "\n".join(parts)


def failure_reason(message: str | None, sent: list[dict]) -> str | None:
    """The server's words about a failed request, fit to print: terminal control characters removed,
    one line, cut where it starts quoting the request, at most ``REASON_CHARS``; ``WITHHELD`` where
    three of its words in a row still appear in the request's messages ``sent``."""
    if not message:
        return None
    text = " ".join(printable(message, one_line=True).split())
    m = _QUOTES_INPUT.search(text)
    if m:
        text = text[:m.start()].rstrip(" ,;:([{") + " ..."
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS].rstrip() + "..."
    words = text.split()
    # the request's words as the reason's are: any run of spaces, newlines and indents as one space
    sent_text = " ".join(printable(_request_text(sent), one_line=True).split())
    for i in range(len(words) - 2):
        phrase = " ".join(words[i:i + 3])
        if len(phrase) >= 12 and phrase in sent_text:
            return WITHHELD
    return text or None


def reason_class(reason: str) -> str:
    """A reason with its numbers as ``N``: the failures it groups differ in lengths and counts only."""
    return _NUMBER.sub("N", reason)


@dataclass
class ToolCheck:
    """What the regenerated answer's tool calls are worth."""
    calls: int = 0
    parsed: bool = True
    offered: bool = True
    json_args: bool = True

    @property
    def valid(self) -> bool:
        return self.calls > 0 and self.parsed and self.offered and self.json_args


def check_tool_calls(calls: list[dict], offered: frozenset[str]) -> ToolCheck:
    """The three checks of the module docstring on calls assembled from a stream."""
    out = ToolCheck(calls=len(calls))
    for c in calls:
        fn = c.get("function") or {}
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not name or not isinstance(args, str):
            out.parsed = False
            continue
        if name not in offered:
            out.offered = False
        try:  # the server's arguments: nested too deep is no JSON object this check reads
            ok = not depth_over(args or "{}") and isinstance(json.loads(args or "{}"), dict)
        except (json.JSONDecodeError, RecursionError):
            ok = False
        out.json_args = out.json_args and ok
    return out


@dataclass
class TurnResult:
    """One regenerated turn: where it sits, what was sent (lengths only) and what came back."""
    conversation: str
    turn: int                   # its position among the conversation's assistant turns, from 1
    loop: int = 0               # the soak's pass over the trace
    start_s: float = 0.0        # from the run's start
    end_s: float = 0.0
    error: str | None = None    # the kind of failure ("http 500", "connect", "timeout", ...); None: answered
    reason: str | None = None   # the server's words about it (``failure_reason``), where it gave any
    messages: int = 0
    prompt_chars: int = 0
    recorded_tool_call: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int | None = None
    steps: int = 0
    tool: ToolCheck | None = None
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def decode_tok_s(self) -> float | None:
        if self.decode_tokens and self.decode_s and self.decode_s > 0:
            return self.decode_tokens / self.decode_s
        return None

    @property
    def tpot_s(self) -> float | None:
        r = self.decode_tok_s
        return 1 / r if r else None

    @property
    def e2e_tok_s(self) -> float | None:
        return self.completion_tokens / self.total_s if self.total_s and self.total_s > 0 else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["tool"] = {**asdict(self.tool), "valid": self.tool.valid} if self.tool else None
        return d | {"decode_tok_s": self.decode_tok_s, "e2e_tok_s": self.e2e_tok_s}


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least ``p`` (0-100) percent of the values at or below it."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return None
    return vals[max(math.ceil(p / 100 * len(vals)) - 1, 0)]


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, t: TurnResult) -> bool:
        if not t.ok:
            return False
        if self.ttft_s is not None and (t.ttft_s is None or t.ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and (t.tpot_s is None or t.tpot_s > self.tpot_s):
            return False
        return True

    def to_json(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


def parse_slo(text: str) -> Slo:
    """``ttft=0.5,tpot=0.05`` (seconds; ``ms`` suffix for milliseconds)."""
    from hybrid_build.core.errors import UserError

    values: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in ("ttft", "tpot"):
            raise UserError(f"--slo {text}: expected ttft=SECONDS,tpot=SECONDS (e.g. ttft=2,tpot=50ms)")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            v = float(raw[:-2] if raw.endswith("ms") else raw.rstrip("s")) * scale
        except ValueError:
            raise UserError(f"--slo: {key}={raw}: not a time")
        if not v > 0:
            raise UserError(f"--slo: {key} must be above 0")
        values[key] = v
    if not values:
        raise UserError("--slo: give ttft=..., tpot=... or both")
    return Slo(values.get("ttft"), values.get("tpot"))


@dataclass
class Counters:
    """vLLM's server-wide counters around a stretch of the run (deltas); None where not exposed."""
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    extra: dict = field(default_factory=dict)


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(turns: list[TurnResult], wall_s: float, slo: Slo | None = None,
              counters: Counters | None = None) -> dict:
    """The figures of a set of turns (all of a run, one position, one window)."""
    ok = [t for t in turns if t.ok]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    dec = [t.decode_tok_s for t in ok if t.decode_tok_s is not None]
    e2e = [t.e2e_tok_s for t in ok if t.e2e_tok_s is not None]
    dec_tokens = sum(t.decode_tokens or 0 for t in ok if t.decode_tok_s is not None)
    dec_time = sum(t.decode_s or 0 for t in ok if t.decode_tok_s is not None)
    comp = sum(t.completion_tokens for t in ok)
    total = sum(t.total_s or 0 for t in ok)
    usage = [t for t in ok if t.cached_tokens is not None and t.prompt_tokens]
    steps = sum(t.steps for t in ok if t.decode_tokens)
    tools = [t.tool for t in ok if t.tool is not None and t.tool.calls]
    errors: dict[str, int] = {}
    for t in turns:
        if t.error:
            errors[t.error] = errors.get(t.error, 0) + 1
    out = {
        "requests": len(turns), "ok": len(ok), "errors": errors, "error_reasons": error_reasons(turns),
        "ttft_s": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
        "decode_tok_s": {"p50": percentile(dec, 50), "p95_low": percentile(dec, 5),
                         "aggregate": _ratio(dec_tokens, dec_time)},
        "e2e_tok_s": {"p50": percentile(e2e, 50), "aggregate": _ratio(comp, total)},
        "completion_tokens": comp,
        "prompt_tokens": sum(t.prompt_tokens or 0 for t in ok),
        "prefix_cache": {
            "usage_hit_rate": _ratio(sum(t.cached_tokens for t in usage), sum(t.prompt_tokens for t in usage)),
            "usage_turns": len(usage)},
        "tokens_per_step": _ratio(dec_tokens if steps else None, steps),
        "tool_calls": {
            "recorded_call_turns": sum(1 for t in ok if t.recorded_tool_call),
            "answered_with_calls": len(tools),
            "recorded_call_answered_with_call": sum(1 for t in ok if t.recorded_tool_call and t.tool
                                                    and t.tool.calls),
            "valid": sum(1 for c in tools if c.valid),
            "validity": _ratio(sum(1 for c in tools if c.valid), len(tools)),
            "unparsed": sum(1 for c in tools if not c.parsed),
            "not_offered": sum(1 for c in tools if c.parsed and not c.offered),
            "args_not_json": sum(1 for c in tools if c.parsed and not c.json_args)},
    }
    if counters is not None:
        out["prefix_cache"]["counter_hit_rate"] = _ratio(counters.prefix_hits, counters.prefix_queries)
        out["prefix_cache"]["counter_queries"] = counters.prefix_queries
        if counters.drafts:
            out["acceptance"] = {
                "drafts": counters.drafts, "mean_acceptance_length": 1 + counters.accepted_tokens / counters.drafts,
                "draft_acceptance_rate": _ratio(counters.accepted_tokens, counters.draft_tokens)}
        else:
            out["acceptance"] = None
    if slo is not None:
        good = sum(1 for t in turns if slo.met(t))
        out["goodput"] = {"slo": slo.to_json(), "good": good, "share": _ratio(good, len(turns)),
                          "per_s": good / wall_s if wall_s > 0 else None}
    return out


def error_reasons(turns: list[TurnResult]) -> list[dict]:
    """The failures grouped by kind and by the server's words (numbers as N), most frequent first:
    ``{"kind", "reason", "count", "example"}`` (``example``: one failure's words as sent)."""
    groups: dict[tuple[str, str], dict] = {}
    for t in turns:
        if t.error:
            key = (t.error, reason_class(t.reason) if t.reason else "")
            g = groups.setdefault(key, {"kind": t.error, "reason": key[1] or None, "count": 0, "example": t.reason})
            g["count"] += 1
    return sorted(groups.values(), key=lambda g: (-g["count"], g["kind"], g["reason"] or ""))[:REASON_GROUPS]


def reason_lines(reasons: list[dict]) -> list[str]:
    """The failures by reason, one line each, for the text reports."""
    return [f"failed: {g['count']} x {g['kind']}" + (f": {g['reason']}" if g["reason"] else "") for g in reasons]


def fit_line(fit: dict) -> str:
    """What the check before the replay found: the turns longer than the server takes, the longest."""
    limit, mt = fit.get("max_model_len"), fit.get("max_tokens")
    if not limit:
        return "fit: the server states no max_model_len (/v1/models): the turns were not checked against it"
    if not fit.get("counted_by"):
        return (f"fit: not counted before the replay ({fit.get('why')}); a turn longer than max_model_len "
                f"{limit:,} fails with the server's reason")
    longest = fit.get("longest") or {}
    where = f" ({longest['conversation']}, turn {longest['turn']})" if longest.get("conversation") else ""
    head = (f"fit: {fit['too_long']} of {fit['turns']} turns are longer than the server's max_model_len {limit:,} "
            f"takes (prompt + {mt} completion tokens, counted by its /tokenize); the longest prompt is "
            f"{longest.get('tokens', 0):,} tokens{where}")
    if not fit["too_long"]:
        return head
    return head + ("; left out (--skip-too-long)" if fit.get("skipped") else
                   "; they will fail: --skip-too-long leaves them out")


def bucket_of(turn: int) -> str:
    for lo, hi in POSITION_BUCKETS:
        if turn >= lo and (hi is None or turn <= hi):
            return str(lo) if lo == hi else (f"{lo}-{hi}" if hi else f"{lo}+")
    return str(turn)


def by_position(turns: list[TurnResult], wall_s: float, slo: Slo | None) -> list[dict]:
    groups: dict[str, list[TurnResult]] = {}
    for t in sorted(turns, key=lambda t: t.turn):
        groups.setdefault(bucket_of(t.turn), []).append(t)
    return [{"position": k, **summarize(v, wall_s, slo)} for k, v in groups.items()]


# ---- text ----------------------------------------------------------------------------------------

def _f(v, fmt="{:.1f}", scale=1.0) -> str:
    return "-" if v is None else fmt.format(v * scale)


def _row(label: str, s: dict, width: int) -> str:
    pc = s["prefix_cache"]
    hit = pc["usage_hit_rate"] if pc.get("counter_hit_rate") is None else pc["counter_hit_rate"]
    tc = s["tool_calls"]
    valid = f"{tc['valid']}/{tc['answered_with_calls']}" if tc["answered_with_calls"] else "-"
    good = s.get("goodput")
    return (f"{label:<{width}} {s['requests']:>5} {sum(s['errors'].values()):>4}  "
            f"{_f(s['ttft_s']['p50'], '{:.0f}', 1000):>7} {_f(s['ttft_s']['p95'], '{:.0f}', 1000):>7}  "
            f"{_f(s['decode_tok_s']['p50']):>7} {_f(s['decode_tok_s']['aggregate']):>7}  "
            f"{_f(s['e2e_tok_s']['aggregate']):>7}  {_f(hit, '{:.0%}'):>5}  {_f(s['tokens_per_step'], '{:.2f}'):>5}  "
            f"{valid:>7}" + (f"  {_f(good['share'], '{:.0%}'):>5}" if good else ""))


def table(report: dict) -> str:
    """The replay's report as text: overall, then per turn position."""
    o = report["overall"]
    src = report["trace"]
    head = (f"{src['format']} {src['name']}: {report['conversations']} conversations, {o['requests']} turns "
            f"regenerated, {report['concurrency']} at once, history {report['feed_back']}, temperature 0, up to "
            f"{report['max_tokens']} tokens; {report['base_url']} ({report['model']})")
    cols = (f"{'position':<8} {'turns':>5} {'err':>4}  {'TTFT ms':>7} {'p95':>7}  {'decode':>7} {'agg':>7}  "
            f"{'e2e':>7}  {'hit':>5}  {'tok/st':>5}  {'tools':>7}" + ("  good" if o.get("goodput") else ""))
    lines = [head, "TTFT p50/p95 ms; decode tok/s p50 and aggregate; e2e tok/s aggregate (completion tokens over "
                   "wall time incl. prefill); hit: prefix-cache hit rate; tok/st: decode tokens per engine step; "
                   "tools: valid calls / answers with calls", cols, _row("all", o, 8)]
    lines += [_row(p["position"], p, 8) for p in report["per_position"]]
    pc = o["prefix_cache"]
    if pc.get("counter_hit_rate") is not None:
        lines.append(f"prefix cache: {pc['counter_hit_rate']:.1%} of {pc['counter_queries']:.0f} queried prompt "
                     f"tokens hit (vLLM's counters, server-wide)" + (
                         f"; usage's cached tokens: {pc['usage_hit_rate']:.1%}" if pc["usage_hit_rate"] is not None
                         else ""))
    elif pc["usage_hit_rate"] is not None:
        lines.append(f"prefix cache: {pc['usage_hit_rate']:.1%} of prompt tokens cached (usage, {pc['usage_turns']} "
                     f"turns)")
    else:
        lines.append("prefix cache: no counters on /metrics and no cached tokens in usage (vLLM: "
                     "--enable-prompt-tokens-details gives them per turn)")
    acc = o.get("acceptance")
    lines.append(f"acceptance: mean length {acc['mean_acceptance_length']:.2f}" + (
        f", {acc['draft_acceptance_rate']:.0%} of draft tokens" if acc["draft_acceptance_rate"] is not None else "")
        + f" over {acc['drafts']:.0f} drafts (vLLM's counters, server-wide)" if acc
        else "acceptance: no speculative-decoding counters on /metrics")
    tc = o["tool_calls"]
    lines.append(f"tool calls: {tc['answered_with_calls']} answers carried calls "
                 f"({tc['recorded_call_answered_with_call']} of the {tc['recorded_call_turns']} turns recorded as "
                 f"calls); {tc['valid']} valid, "
                 f"{tc['unparsed']} unparsed, {tc['not_offered']} naming a tool not offered, {tc['args_not_json']} "
                 f"with arguments not a JSON object")
    if o.get("goodput"):
        g = o["goodput"]
        lines.append(f"goodput: {g['good']} of {o['requests']} turns within ttft<={g['slo']['ttft_s']} s, "
                     f"tpot<={g['slo']['tpot_s']} s ({_f(g['share'], '{:.0%}')}; {_f(g['per_s'], '{:.2f}')} per s)")
    lines += reason_lines(o.get("error_reasons") or [])
    if report.get("fit"):
        lines.append(fit_line(report["fit"]))
    if report.get("synthetic"):
        p = report["synthetic"]
        lines.append(f"synthetic trace: {json.dumps(p['parameters'])}; measured {json.dumps(p['measured'])}")
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    return "\n".join(lines)
