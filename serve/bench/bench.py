"""Speed and speculative acceptance of OpenAI-compatible servers, one stream or N at once, and their A/B.

A **workload bank** (prose, code, counting, an agent turn that answers with a tool call) runs at
temperature 0, one request at a time. Each workload runs ``runs + 1`` times per server; the first
run warms caches and is discarded. Per run: decode tok/s = tokens generated after the first one /
(last token time - first token time), which excludes the time to first token; end-to-end tok/s =
completion tokens / wall time of the request; TTFT. Where the server counts tokens in every chunk
(``stream_options.continuous_usage_stats``: vLLM, SGLang), the first and last token times and the
tokens between them come from those counts, so a token whose text the detokenizer holds back (a
partial UTF-8 character: chunks with empty content) still counts where it was generated. Else the
times are those of the first and last chunks with content, and the tokens the final ``usage``
count (``stream_options.include_usage``) minus one, or the number of content chunks minus one. A
workload's figure is the median of its runs; its spread is their range (min-max).

**Acceptance**: around every measured run the server's Prometheus ``/metrics`` (vLLM's, at the
server root) is read, and the deltas of vLLM's speculative-decoding counters
(``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``; exposed with the ``_total`` suffix) give per workload the mean
acceptance length ``1 + accepted / drafts`` (vLLM's own definition: it counts the bonus token) and
the draft acceptance rate ``accepted / draft tokens``. The counters are server-wide: other traffic
on the same server during a run is counted too.

**Concurrent streams** (``concurrency`` N > 1): rounds of N requests at once, one thread each,
released together by a barrier. Stream i runs the i-th workload of the list, cycling; a workload's
k-th stream asks the same with "Request k." before its first user message, so no two streams
send one prompt. One warm-up round is discarded. Per stream: the same three figures, median over
the rounds, and its **overlap**: the share of its decode window (first to last token) during which
all N streams were decoding, so a stream that ran partly alone shows it. Per round: total tok/s
(completion tokens of all streams / round wall time), mean and min of the per-stream decode tok/s.
The counters are server-wide, so they give the acceptance of all streams together; a stream's own
is its decode tokens per chunk with new tokens (vLLM streams each engine step as one chunk: its
accepted drafts plus the bonus token), checked against the counters: the streams' chunk steps
must equal the counters' drafts, else the report says which way the per-stream figures lean.

**A/B** (``compare``): per workload (per stream) and metric, both medians and ranges, the ratio B/A
and a verdict ("B faster by x%") only when the two ranges of runs do not overlap (every run of one
beat every run of the other; under no real difference that happens by chance with probability
2 / C(2n, n): 10% at 3 runs each, 2.9% at 4, 0.8% at 5), else "within noise". Two servers measured
in one call are interleaved (A, B, A, B...) so that drift hits both. Reports of different
concurrency are not compared. **Low acceptance**: a side
whose accepted tokens per draft (mean acceptance length - 1) fall below half of the other side's,
and at least 0.25 tokens lower, is flagged: that is the known failure of a build that dropped (or
mangled) the MTP or drafter weights: the drafter keeps proposing and almost nothing lands. The
bonus token is left out of that ratio because it is there even for a useless drafter (a garbage
1-token MTP has length 1.0 against a healthy one's ~1.8: a ratio of 0.56 that would hide it).

Every request goes through ``core/http_client`` (one pooled client per API key, a deadline for the
whole request, the body-size cap, SSE parsing, ``/metrics`` through prometheus_client's parser).
An API key goes to every request (chat, ``/v1/models``, ``/metrics``) as a Bearer token and
nowhere else: a redirect is not followed (exit 2, one line); a 401/403 is ``KeyRefused`` (exit 2),
one line that names the server, never the key. An answer the protocol does not allow (HTML, not
JSON, no model list, a ``/metrics`` that is not Prometheus text, cut off, too large) is one line,
exit 3.
"""
from __future__ import annotations

import logging
import math
import operator
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from hybrid_build.core.errors import ErrorStatus, ExternalToolError, ProtocolViolation, UserError

from .workloads import (
    LENGTH_MISMATCH,
    LOW_ACCEPTANCE_FRACTION,
    LOW_ACCEPTANCE_MIN_GAP,
    LOW_OVERLAP,
    MAX_CONCURRENCY,
    MIN_DRAFTS,
    MIN_RUNS_FOR_VERDICT,
    USELESS_DRAFTER,
    WORKLOADS,
    Workload,
)

if TYPE_CHECKING:  # httpx is imported with the client, when a request is made: `bench --help` reads this module
    from hybrid_build.core.http_client import HttpClient, Metrics

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
REPORT_KIND = "hybrid-build bench"
COMPARISON_KIND = "hybrid-build bench comparison"

# ---- vLLM's speculative-decoding counters --------------------------------------------------------

# the names vLLM registers (vllm/v1/spec_decode/metrics.py, SpecDecodingProm, 0.23 to 0.33); the
# Prometheus text exposition adds `_total` to each counter's samples. A test reads them from the
# real sources of every supported version.
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_COUNTERS = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, SPEC_ACCEPTED_PER_POS)

@dataclass(frozen=True)
class SpecCounts:
    """vLLM's speculative-decoding counters (summed over engines), or the difference of two readings."""
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_pos: tuple[float, ...] = ()

    def _combine(self, other: "SpecCounts", op) -> "SpecCounts":
        """Field by field; the per-position counts padded with zeros to the longer of the two."""
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0.0,) * (n - len(other.accepted_per_pos))
        return SpecCounts(op(self.drafts, other.drafts), op(self.draft_tokens, other.draft_tokens),
                          op(self.accepted_tokens, other.accepted_tokens), tuple(op(x, y) for x, y in zip(a, b)))

    def __sub__(self, other: "SpecCounts") -> "SpecCounts":
        return self._combine(other, operator.sub)

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        return self._combine(other, operator.add)

    @classmethod
    def total(cls, deltas: list[dict]) -> "SpecCounts":
        """The sum of counter deltas as reports store them (``"spec"`` of a run or a round)."""
        out = cls(0, 0, 0)
        for sp in deltas:
            out = out + cls(sp["drafts"], sp["draft_tokens"], sp["accepted_tokens"], tuple(sp["accepted_per_pos"]))
        return out


def spec_counts(metrics: Metrics | str) -> SpecCounts | None:
    """vLLM's speculative-decoding counters in a ``/metrics`` exposition (parsed, or its text), summed
    over engines; None when the server exposes none (it does not speculate, or it is not vLLM)."""
    if isinstance(metrics, str):
        from hybrid_build.core.http_client import parse_metrics

        metrics = parse_metrics("/metrics", metrics.encode())
    m = metrics
    found = [m.samples(n) for n in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)]
    if any(not f for f in found):
        return None
    per_pos: dict[int, float] = {}
    for labels, value in m.samples(SPEC_ACCEPTED_PER_POS):
        if labels.get("position", "").isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    drafts, draft_tokens, accepted = (sum(v for _, v in f) for f in found)
    return SpecCounts(drafts, draft_tokens, accepted, positions)


def client(api_key: str | None) -> HttpClient:
    """The process's pooled client for this key, with a connection for every stream at once."""
    from hybrid_build.core.http_client import shared_client

    return shared_client(api_key, 600.0, MAX_CONCURRENCY)


def read_metrics(base_url: str, timeout: float = 30.0, api_key: str | None = None) -> Metrics | None:
    """The server's ``/metrics`` now; None when it answers an error status there (none served)."""
    from hybrid_build.core.http_client import metrics_url

    url = metrics_url(base_url)
    try:
        return client(api_key).metrics(url, timeout)
    except ErrorStatus as e:
        log.debug("%s: HTTP %s, no acceptance figures", url, e.status)
        return None


def read_spec_counts(base_url: str, timeout: float = 30.0, api_key: str | None = None) -> SpecCounts | None:
    """The server's speculative-decoding counters now; None when it has no ``/metrics`` or none there."""
    m = read_metrics(base_url, timeout, api_key)
    return None if m is None else spec_counts(m)


def acceptance_of(c: SpecCounts) -> dict:
    """The figures vLLM's own log line prints, from counter deltas."""
    return {"drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
            "accepted_per_pos": list(c.accepted_per_pos),
            "mean_acceptance_length": 1 + c.accepted_tokens / c.drafts,
            "accepted_per_draft": c.accepted_tokens / c.drafts,
            "draft_acceptance_rate": c.accepted_tokens / c.draft_tokens if c.draft_tokens else None,
            "per_position_rate": [p / c.drafts for p in c.accepted_per_pos]}


# ---- one request ---------------------------------------------------------------------------------

@dataclass
class RunSample:
    """One measured request: its timings (seconds) and, on a speculating vLLM, its counter deltas."""
    tokens: int
    ttft_s: float
    total_s: float
    decode_s: float
    spec: dict | None = None
    # tokens generated between the first and the last token time, where the server counted them
    # in every chunk; None: tokens - 1
    decode_tokens: int | None = None

    @property
    def decode_tok_s(self) -> float | None:
        n = self.tokens - 1 if self.decode_tokens is None else self.decode_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    @property
    def e2e_tok_s(self) -> float | None:
        return self.tokens / self.total_s if self.total_s > 0 else None

    def to_json(self) -> dict:
        return {**asdict(self), "decode_tok_s": self.decode_tok_s, "e2e_tok_s": self.e2e_tok_s}


def chat_events(base_url: str, body: dict, api_key: str | None, timeout: float):
    """A streamed chat completion's events (``HttpClient.stream_events``); an error status is one line
    naming the URL, with what to do where a server refuses tools."""
    try:
        yield from client(api_key).stream_events(base_url.rstrip("/") + "/chat/completions", body, timeout)
    except ErrorStatus as e:
        raise ExternalToolError(str(e) + _tools_hint(body, e.status)) from None


def _tools_hint(body: dict, code: int) -> str:
    """What to do when a server refuses a request that carries tools (vLLM started without a
    tool-call parser answers 400): leave the workloads with tools out, or serve with a parser."""
    if code != 400 or not body.get("tools"):
        return ""
    with_tools = [name for name, w in WORKLOADS.items() if w.tools]
    rest = ",".join(name for name in WORKLOADS if name not in with_tools)
    return (f" (the {', '.join(with_tools)} workload sends tools: serve with a tool-call parser, "
            f"or leave it out with --workloads {rest})")


def first_model(base_url: str, timeout: float = 10.0, api_key: str | None = None) -> str:
    url = base_url.rstrip("/") + "/models"
    data = client(api_key).get_json(url, timeout)
    try:
        model = data["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ProtocolViolation(f"{url} answered no model list (not an OpenAI-compatible server?)") from None
    if not isinstance(model, str) or not model:
        raise ProtocolViolation(f"{url} answered a model without an id")
    return model


def request_body(workload: Workload, model: str, max_tokens: int, thinking: bool) -> dict:
    body: dict = {"model": model, "messages": list(workload.messages), "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if workload.tools:
        body["tools"] = list(workload.tools)
    if not thinking:
        # Qwen3.5's template thinks first by default: each workload should produce its own kind of text
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


@dataclass(frozen=True)
class StreamTimes:
    """One streamed request's clock readings (``time.perf_counter``) and its engine steps: the
    chunks after the first in which new tokens arrived (one per engine step where the server sends
    every step as it comes, as vLLM does: a step's accepted drafts and bonus token in one chunk)."""
    start: float
    first: float
    last: float
    end: float
    steps: int


def stream_timed(base_url: str, model: str, workload: Workload | str, max_tokens: int, thinking: bool = False,
                 timeout: float = 600.0, api_key: str | None = None) -> tuple[RunSample, StreamTimes]:
    """One streamed chat completion, timed from the request to the first and last token-bearing
    chunks: by the server's running token count where every chunk carries one, else by content."""
    workload = WORKLOADS[workload] if isinstance(workload, str) else workload
    body = request_body(workload, model, max_tokens, thinking)
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    counted: list[tuple[float, int]] = []  # (time, running completion-token count) where it grew
    for event in chat_events(base_url, body, api_key, timeout):
        usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
        if usage:
            usage_tokens = usage.get("completion_tokens")
            if not isinstance(usage_tokens, int) or isinstance(usage_tokens, bool):
                usage_tokens = None
            if event.get("choices") and usage_tokens and (not counted or usage_tokens > counted[-1][1]):
                counted.append((time.perf_counter(), usage_tokens))
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            delta = (choice.get("delta") if isinstance(choice, dict) else None) or {}
            if not isinstance(delta, dict):
                continue
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                    or delta.get("tool_calls"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    t_end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    if counted:
        (t_first, n_first), (t_last, n_last) = counted[0], counted[-1]
        return (RunSample(tokens, t_first - t0, t_end - t0, t_last - t_first, decode_tokens=n_last - n_first),
                StreamTimes(t0, t_first, t_last, t_end, len(counted) - 1))
    if first is None:
        first = last = t_end
    last = last or t_end
    return RunSample(tokens, first - t0, t_end - t0, last - first), StreamTimes(t0, first, last, t_end,
                                                                                max(chunks - 1, 0))


def stream_once(base_url: str, model: str, workload: Workload | str, max_tokens: int, thinking: bool = False,
                timeout: float = 600.0, api_key: str | None = None) -> RunSample:
    """One streamed chat completion's sample (``stream_timed`` without the clock readings)."""
    return stream_timed(base_url, model, workload, max_tokens, thinking, timeout, api_key)[0]


@dataclass
class Server:
    """A server under test: its label in an A/B, its OpenAI base URL, the model it serves and the
    API key sent as a Bearer token (never shown)."""
    label: str
    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)

    def spec_counts(self) -> SpecCounts | None:
        return read_spec_counts(self.base_url, api_key=self.api_key)

    def measure(self, workload: Workload, max_tokens: int, thinking: bool) -> RunSample:
        """One request, with vLLM's speculative-decoding counters read just before and just after it."""
        before = self.spec_counts()
        sample = stream_once(self.base_url, self.model, workload, max_tokens, thinking, api_key=self.api_key)
        after = self.spec_counts() if before is not None else None
        if before is not None and after is not None:
            sample.spec = _spec_json(after - before)
        return sample

    def measure_round(self, streams: list["Stream"], max_tokens: int, thinking: bool) -> tuple[list, dict]:
        """The streams at once, with the (server-wide) counters read just before and just after them."""
        before = self.spec_counts()
        timed = at_once([lambda s=s: stream_timed(self.base_url, self.model, s.request, max_tokens, thinking,
                                                  api_key=self.api_key) for s in streams])
        after = self.spec_counts() if before is not None else None
        return concurrent_round(streams, timed, _spec_json(after - before) if after is not None else None)


def _spec_json(d: SpecCounts) -> dict:
    return {"drafts": d.drafts, "draft_tokens": d.draft_tokens, "accepted_tokens": d.accepted_tokens,
            "accepted_per_pos": list(d.accepted_per_pos)}


# ---- streams at once -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Stream:
    """One of N concurrent streams: its number (from 1), the bank's workload it runs, and the
    request it sends (the workload's own for the first stream of a workload; ``variant`` k > 1 puts
    "Request k." before the first user message, so that no two streams send the same prompt)."""
    number: int
    workload: str
    variant: int
    request: Workload

    @property
    def label(self) -> str:
        return f"{self.number}:{self.workload}"


def plan_streams(names: list[str], concurrency: int) -> list[Stream]:
    """Stream i runs the i-th of the workloads, cycling through them."""
    out = []
    for i in range(concurrency):
        name, variant = names[i % len(names)], i // len(names) + 1
        w = WORKLOADS[name]
        if variant > 1:
            at = next(j for j, m in enumerate(w.messages) if m["role"] == "user")
            messages = list(w.messages)
            messages[at] = {**messages[at], "content": f"Request {variant}. {messages[at]['content']}"}
            w = Workload(w.name, w.about, tuple(messages), w.tools)
        out.append(Stream(i + 1, name, variant, w))
    return out


@dataclass
class StreamSample(RunSample):
    """One stream's request in a round of concurrent streams: the sample, when its request started,
    its first and last token and its end came (seconds from the round's first request), the engine
    steps it saw (chunks with new tokens after the first) and the share of its decode window
    during which every stream of the round was decoding."""
    stream: int = 0
    start_s: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    end_s: float = 0.0
    steps: int = 0
    overlap: float | None = None

    @property
    def decoded(self) -> int:
        return max(self.tokens - 1, 0) if self.decode_tokens is None else self.decode_tokens


def at_once(calls: list[Callable]) -> list:
    """Each call on its own thread, released together by a barrier (one call: in this thread), the
    results in the calls' order; a failure of any is raised here once all have ended (a refused key
    first: the user's to fix). A thread that cannot start breaks the barrier, so the ones started
    end instead of waiting for it forever."""
    if len(calls) == 1:
        return [calls[0]()]
    barrier = threading.Barrier(len(calls))
    out: list = [None] * len(calls)

    def one(i: int) -> None:
        try:
            barrier.wait()
            out[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,), name=f"bench-stream-{i + 1}", daemon=True)
               for i in range(len(calls))]
    started = []
    try:
        for t in threads:
            t.start()
            started.append(t)
    except BaseException:
        barrier.abort()  # the started ones would wait for the rest forever
        for t in started:
            t.join()
        raise
    for t in threads:
        t.join()
    errors = [o for o in out if isinstance(o, BaseException)]
    if errors:
        # a refused key is the user's to fix: say that one rather than whichever stream failed first
        raise next((e for e in errors if isinstance(e, UserError)), errors[0])
    return out


def overlaps(windows: list[tuple[float, float]]) -> tuple[float, list[float | None]]:
    """The time during which every stream was decoding (between its first and last token) and, per
    stream, the share of its own decode window that this time covers (None: no window). A stream
    of one token has no window, so all N never decoded at once: 0 for the others."""
    common = max(0.0, min(b for _, b in windows) - max(a for a, _ in windows))
    return common, [min(1.0, common / (b - a)) if b > a else None for a, b in windows]


def peak_decoding(windows: list[tuple[float, float]]) -> int:
    """The most streams decoding (between their first and last token) at one moment. A server that
    batches fewer sequences than the streams sent (vLLM's --max-num-seqs) queues the rest, which
    start after others end: the peak stays below N. A window ending as another starts is not shared."""
    events = sorted([(b, -1) for a, b in windows if b > a] + [(a, 1) for a, b in windows if b > a])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def concurrent_round(streams: list[Stream], timed: list[tuple[RunSample, StreamTimes]],
                     spec: dict | None) -> tuple[list[StreamSample], dict]:
    """The samples of one round of concurrent streams and the round's aggregate."""
    t0 = min(t.start for _, t in timed)
    common, shares = overlaps([(t.first, t.last) for _, t in timed])
    samples = [StreamSample(**asdict(s), stream=st.number, start_s=t.start - t0, first_s=t.first - t0,
                            last_s=t.last - t0, end_s=t.end - t0, steps=t.steps, overlap=share)
               for st, (s, t), share in zip(streams, timed, shares)]
    wall = max(t.end for _, t in timed) - t0
    tokens = sum(s.tokens for s in samples)
    decode = [s.decode_tok_s for s in samples if s.decode_tok_s is not None]
    return samples, {"wall_s": wall, "tokens": tokens, "total_tok_s": tokens / wall if wall > 0 else None,
                     "mean_decode_tok_s": statistics.fmean(decode) if decode else None,
                     "min_decode_tok_s": min(decode) if decode else None, "all_decoding_s": common,
                     "peak_decoding": peak_decoding([(t.first, t.last) for _, t in timed]),
                     "chunk_steps": sum(s.steps for s in samples), "spec": spec}


def chunk_acceptance(samples: list[StreamSample], draft_len: float | None) -> dict | None:
    """A stream's acceptance where the counters are server-wide: its decode tokens per engine step
    (chunk with new tokens), summed over its runs. One chunk per step (vLLM's streaming: a step's
    accepted drafts and bonus token together), so tokens per chunk is the mean acceptance length;
    a last step cut by max_tokens or a stop reads low, steps merged into one chunk read high."""
    steps = sum(s.steps for s in samples)
    if steps <= 0:
        return None
    tokens = sum(s.decoded for s in samples)
    length = tokens / steps
    lengths = [s.decoded / s.steps for s in samples if s.steps > 0]
    return {"basis": "tokens per streamed chunk", "drafts": steps,
            "draft_tokens": steps * draft_len if draft_len else None, "accepted_tokens": tokens - steps,
            "accepted_per_pos": [], "mean_acceptance_length": length, "accepted_per_draft": length - 1,
            "draft_acceptance_rate": (length - 1) / draft_len if draft_len else None, "per_position_rate": [],
            "mean_acceptance_length_spread": [min(lengths), max(lengths)]}


def acceptance_basis(chunk_steps: int, drafts: float) -> dict:
    """What the per-stream acceptance rests on, checked against the server-wide counters."""
    head = ("decode tokens per streamed chunk (vLLM streams each engine step as one chunk: its accepted "
            "drafts plus the bonus token), as the /metrics counters are server-wide; ")
    if chunk_steps == drafts:
        tail = f"checked: the streams' {chunk_steps} chunk steps are the counters' {drafts:.0f} drafts"
    elif chunk_steps < drafts:
        tail = (f"the streams' {chunk_steps} chunk steps are fewer than the counters' {drafts:.0f} drafts: the "
                f"server merged steps into chunks (or a tool-call or reasoning parser held tokens back, or other "
                f"traffic ran), so the per-stream figures read high")
    else:
        tail = (f"the streams' {chunk_steps} chunk steps exceed the counters' {drafts:.0f} drafts: some steps "
                f"carried no draft, so the per-stream figures read low")
    return {"method": "tokens per streamed chunk", "chunk_steps": chunk_steps, "drafts": drafts,
            "one_chunk_per_step": chunk_steps == drafts, "text": head + tail}


# ---- a run of the bank ---------------------------------------------------------------------------

def _stats(values: Iterable[float | None]) -> dict | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(workload: str, samples: list[RunSample]) -> dict:
    """A workload's result: medians and ranges of its runs, the runs themselves, and the acceptance
    over all of them (counter deltas summed, so a long run weighs more than a short one)."""
    stats = {"tokens": _stats(s.tokens for s in samples), "ttft_s": _stats(s.ttft_s for s in samples),
             "decode_tok_s": _stats(s.decode_tok_s for s in samples), "e2e_tok_s": _stats(s.e2e_tok_s for s in samples)}
    result = {"workload": workload, "runs": len(samples)}
    for key, st in stats.items():
        result[key] = st["median"] if st else None
    result["spread"] = {k: [st["min"], st["max"]] if st else None for k, st in stats.items()}
    acceptance = None
    specs = [s.spec for s in samples]
    if specs and all(sp is not None for sp in specs):
        total = SpecCounts.total(specs)
        if total.drafts > 0:
            acceptance = acceptance_of(total)
            lengths = [1 + sp["accepted_tokens"] / sp["drafts"] for sp in specs if sp["drafts"] > 0]
            acceptance["mean_acceptance_length_spread"] = [min(lengths), max(lengths)]
    result["acceptance"] = acceptance
    result["samples"] = [s.to_json() for s in samples]
    return result


def row_name(row: dict) -> str:
    """A result's name: its workload, or with concurrent streams "stream:workload"."""
    return f"{row['stream']}:{row['workload']}" if row.get("stream") is not None else row["workload"]


def report_warnings(results: list[dict]) -> list[str]:
    """What one server's results alone can say about its drafter."""
    out = []
    for r in results:
        acc = r.get("acceptance")
        if acc and acc["drafts"] >= MIN_DRAFTS and acc["accepted_per_draft"] < USELESS_DRAFTER:
            out.append(f"{row_name(r)}: the drafter lands {acc['accepted_per_draft']:.2f} tokens per draft "
                       f"(mean acceptance length {acc['mean_acceptance_length']:.2f}): almost nothing. A build that "
                       f"dropped its MTP or drafter weights does this; `bench --compare` against the source tells.")
    return out


def _report(server: Server, runs: int, max_tokens: int, thinking: bool, samples: dict[str, list[RunSample]]) -> dict:
    results = [summarize(name, s) for name, s in samples.items()]
    return {"kind": REPORT_KIND, "schema_version": SCHEMA_VERSION, "base_url": server.base_url,
            "model": server.model, "runs": runs, "max_tokens": max_tokens, "temperature": 0, "thinking": thinking,
            "concurrency": 1, "speculative": any(r["acceptance"] for r in results), "results": results,
            "warnings": report_warnings(results)}


def _concurrent_report(server: Server, runs: int, max_tokens: int, thinking: bool, streams: list[Stream],
                       samples: dict[str, list[StreamSample]], rounds: list[dict]) -> dict:
    server_wide = basis = draft_len = None
    if rounds and all(r["spec"] is not None for r in rounds):
        total = SpecCounts.total([r["spec"] for r in rounds])
        if total.drafts > 0:
            server_wide = acceptance_of(total)
            draft_len = total.draft_tokens / total.drafts
            basis = acceptance_basis(sum(r["chunk_steps"] for r in rounds), total.drafts)
    results = []
    for st in streams:
        ss = samples[st.label]
        row = {"stream": st.number, **summarize(st.workload, ss), "variant": st.variant}
        overlap = _stats(s.overlap for s in ss)
        row["overlap"] = overlap["median"] if overlap else None
        row["spread"]["overlap"] = [overlap["min"], overlap["max"]] if overlap else None
        row["acceptance"] = chunk_acceptance(ss, draft_len) if server_wide else None
        results.append(row)
    stats = {k: _stats(r[k] for r in rounds) for k in ("total_tok_s", "mean_decode_tok_s", "min_decode_tok_s",
                                                        "all_decoding_s")}
    shares = [(s.overlap, label) for label, ss in samples.items() for s in ss if s.overlap is not None]
    lowest = min(shares) if shares else None
    aggregate = {**{k: st["median"] if st else None for k, st in stats.items()},
                 "spread": {k: [st["min"], st["max"]] if st else None for k, st in stats.items()},
                 "overlap": {"median": statistics.median(o for o, _ in shares) if shares else None,
                             "min": lowest[0] if lowest else None, "min_stream": lowest[1] if lowest else None},
                 "peak_decoding": max((r["peak_decoding"] for r in rounds), default=None),
                 "acceptance": server_wide, "acceptance_basis": basis}
    # the useless-drafter warning once, from the counters; streams only where those do not show it
    warnings = report_warnings([{"workload": "all streams", "acceptance": server_wide}]) if server_wide else []
    low = [row_name(r) for r in results if r["acceptance"] and r["acceptance"]["drafts"] >= MIN_DRAFTS
           and r["acceptance"]["accepted_per_draft"] < USELESS_DRAFTER]
    if low and not warnings:
        warnings.append(f"streams {', '.join(low)}: the drafter lands fewer than {USELESS_DRAFTER} tokens per draft "
                        f"(decode tokens per chunk)")
    if basis and not basis["one_chunk_per_step"]:
        warnings.append(f"per-stream acceptance: {basis['text']}")
    peak = aggregate["peak_decoding"]
    if peak is not None and peak < len(streams):
        warnings.append(f"at most {peak} of the {len(streams)} streams were decoding at once in any round: the "
                        f"server ran the others after them (a server batching fewer sequences than --concurrency, "
                        f"vLLM's --max-num-seqs, queues the rest; their TTFTs show the wait), so these figures "
                        f"are not {len(streams)}-stream speed")
    if lowest and lowest[0] < LOW_OVERLAP:
        warnings.append(f"stream {lowest[1]} decoded only {lowest[0]:.0%} of its window while all {len(streams)} "
                        f"streams were decoding: its tok/s was partly measured with fewer streams running")
    return {"kind": REPORT_KIND, "schema_version": SCHEMA_VERSION, "base_url": server.base_url,
            "model": server.model, "runs": runs, "max_tokens": max_tokens, "temperature": 0, "thinking": thinking,
            "concurrency": len(streams), "speculative": server_wide is not None, "results": results,
            "aggregate": aggregate, "rounds": rounds, "warnings": warnings}


ProgressFn = Callable[[str, str, int], None]


def run_servers(servers: list[Server], runs: int, max_tokens: int, workloads: list[str] | None = None,
                thinking: bool = False, on_run: ProgressFn | None = None, concurrency: int = 1) -> list[dict]:
    """The bank on every server, interleaved: per workload one discarded warm-up on each, then
    A, B, A, B... With ``concurrency`` N > 1, rounds of N streams at once instead: a discarded
    warm-up round on each server, then rounds A, B, A, B... Returns one report per server."""
    names = workloads or list(WORKLOADS)
    if concurrency > 1:
        return _run_concurrent(servers, runs, max_tokens, names, thinking, on_run, concurrency)
    samples: dict[str, dict[str, list[RunSample]]] = {s.label: {n: [] for n in names} for s in servers}
    for name in names:
        w = WORKLOADS[name]
        for s in servers:
            stream_once(s.base_url, s.model, w, max_tokens, thinking, api_key=s.api_key)  # warm-up, discarded
            if on_run:
                on_run(s.label, name, 0)
        for i in range(1, runs + 1):
            for s in servers:
                sample = s.measure(w, max_tokens, thinking)
                log.debug("%s %s run %d: %d tokens, TTFT %.3f s, %.3f s in all, spec %s", s.label, name, i,
                          sample.tokens, sample.ttft_s, sample.total_s, sample.spec)
                samples[s.label][name].append(sample)
                if on_run:
                    on_run(s.label, name, i)
    return [_report(s, runs, max_tokens, thinking, samples[s.label]) for s in servers]


def _run_concurrent(servers: list[Server], runs: int, max_tokens: int, names: list[str], thinking: bool,
                    on_run: ProgressFn | None, concurrency: int) -> list[dict]:
    streams = plan_streams(names, concurrency)
    samples: dict[str, dict[str, list[StreamSample]]] = {s.label: {st.label: [] for st in streams} for s in servers}
    rounds: dict[str, list[dict]] = {s.label: [] for s in servers}
    for i in range(runs + 1):  # round 0 is the warm-up, discarded
        for s in servers:
            got, agg = s.measure_round(streams, max_tokens, thinking)
            log.debug("%s round %d: %d streams, %d tokens in %.3f s, all decoding %.3f s, %d chunk steps, spec %s",
                      s.label, i, len(streams), agg["tokens"], agg["wall_s"], agg["all_decoding_s"],
                      agg["chunk_steps"], agg["spec"])
            if i:
                rounds[s.label].append(agg)
                for st, sample in zip(streams, got):
                    samples[s.label][st.label].append(sample)
            if on_run:
                for st in streams:
                    on_run(s.label, st.label, i)
    return [_concurrent_report(s, runs, max_tokens, thinking, streams, samples[s.label], rounds[s.label])
            for s in servers]


def bench(base_url: str, model: str | None = None, runs: int = 5, max_tokens: int = 256,
          workloads: list[str] | None = None, thinking: bool = False, on_run: ProgressFn | None = None,
          concurrency: int = 1, api_key: str | None = None) -> dict:
    """One server's report."""
    server = Server("A", base_url, model or first_model(base_url, api_key=api_key), api_key)
    return run_servers([server], runs, max_tokens, workloads, thinking, on_run, concurrency)[0]


def bench_pair(url_a: str, url_b: str, model: str | None = None, runs: int = 5, max_tokens: int = 256,
               workloads: list[str] | None = None, thinking: bool = False,
               on_run: ProgressFn | None = None, concurrency: int = 1, api_key: str | None = None) -> dict:
    """Two servers measured interleaved, and their comparison (which holds both reports). One API
    key for both."""
    servers = [Server(label, url, model or first_model(url, api_key=api_key), api_key)
               for label, url in (("A", url_a), ("B", url_b))]
    a, b = run_servers(servers, runs, max_tokens, workloads, thinking, on_run, concurrency)
    return compare(a, b, interleaved=True)


# ---- A/B -----------------------------------------------------------------------------------------

# (key in a sample, what the table calls it, higher is better, factor for the table)
METRICS = (("decode_tok_s", "decode tok/s", True, 1.0), ("e2e_tok_s", "e2e tok/s", True, 1.0),
           ("ttft_s", "TTFT ms", False, 1000.0))
# concurrent streams: the aggregate of each round
AGGREGATE_METRICS = (("total_tok_s", "total tok/s", True, 1.0), ("mean_decode_tok_s", "mean decode tok/s", True, 1.0),
                     ("min_decode_tok_s", "min decode tok/s", True, 1.0))


def verdict(a: list[float], b: list[float], higher_is_better: bool) -> tuple[str, bool]:
    """("B faster by x%", True) when the runs' ranges do not overlap, else ("within noise", False).
    x is the gain in speed: for a time (TTFT), speed is its inverse."""
    if len(a) < MIN_RUNS_FOR_VERDICT or len(b) < MIN_RUNS_FOR_VERDICT:
        return f"no verdict: fewer than {MIN_RUNS_FOR_VERDICT} runs", False
    if min(b) <= max(a) and min(a) <= max(b):
        return "within noise", False
    ma, mb = statistics.median(a), statistics.median(b)
    if ma <= 0 or mb <= 0:
        return "within noise", False
    speed = mb / ma if higher_is_better else ma / mb
    if speed >= 1:
        return f"B faster by {100 * (speed - 1):.1f}%", True
    return f"B slower by {100 * (1 - speed):.1f}%", True


def low_acceptance(ref: dict | None, other: dict | None) -> bool:
    """Whether ``other`` accepts well below ``ref`` (the rule in the module docstring)."""
    if not ref or not other or ref["drafts"] < MIN_DRAFTS or other["drafts"] < MIN_DRAFTS:
        return False
    r, o = ref["accepted_per_draft"], other["accepted_per_draft"]
    return o < LOW_ACCEPTANCE_FRACTION * r and r - o >= LOW_ACCEPTANCE_MIN_GAP


def _side(report: dict) -> dict:
    return {k: report.get(k) for k in ("base_url", "model", "runs", "max_tokens", "thinking", "file")} | {
        "concurrency": report.get("concurrency", 1)}


def _metric_row(key: str, label: str, higher: bool, sa: list[float], sb: list[float]) -> dict:
    st_a, st_b = _stats(sa), _stats(sb)
    text, significant = verdict(sa, sb, higher) if sa and sb else ("no data", False)
    return {"metric": key, "label": label, "a": st_a, "b": st_b,
            "ratio": st_b["median"] / st_a["median"] if st_a and st_b and st_a["median"] else None,
            "verdict": text, "significant": significant}


def _acceptance_flag(name: str, acc_a: dict | None, acc_b: dict | None) -> str | None:
    for low, ref, low_acc, ref_acc in (("B", "A", acc_b, acc_a), ("A", "B", acc_a, acc_b)):
        if low_acceptance(ref_acc, low_acc):
            return (f"{name}: {low} lands {low_acc['accepted_per_draft']:.2f} drafted tokens per step "
                    f"(mean acceptance length {low_acc['mean_acceptance_length']:.2f}) against {ref}'s "
                    f"{ref_acc['accepted_per_draft']:.2f} ({ref_acc['mean_acceptance_length']:.2f}): below "
                    f"{LOW_ACCEPTANCE_FRACTION:.0%} of it. This is the known failure of a build that dropped its "
                    f"MTP or drafter weights.")
    return None


def compare(a: dict, b: dict, interleaved: bool = False) -> dict:
    """The A/B of two reports: per workload (per stream, with concurrent streams) the three speed
    figures with verdicts, the acceptance, and the low-acceptance flags; with concurrent streams
    also the aggregate per round. Holds both reports under ``reports``. Reports of different
    concurrency are refused: a stream's speed depends on how many share the server."""
    ca, cb = a.get("concurrency", 1), b.get("concurrency", 1)
    if ca != cb:
        raise UserError(f"A ran {ca} stream(s) at once and B {cb}: compare results of the same --concurrency")
    notes = []
    for key in ("max_tokens", "thinking"):
        if a.get(key) != b.get(key):
            notes.append(f"A and B ran with different {key} ({a.get(key)} vs {b.get(key)}): not like for like")
    by_name = {row_name(r): r for r in b["results"]}
    a_names = [row_name(r) for r in a["results"]]
    for side, names in (("A", [n for n in a_names if n not in by_name]),
                        ("B", [n for n in by_name if n not in a_names])):
        if names:
            notes.append(f"only {side} ran {', '.join(names)}: left out")
    workloads, flags = [], []
    for ra in a["results"]:
        name = row_name(ra)
        rb = by_name.get(name)
        if rb is None:
            continue
        rows = [_metric_row(key, label, higher, [s[key] for s in ra["samples"] if s.get(key) is not None],
                            [s[key] for s in rb["samples"] if s.get(key) is not None])
                for key, label, higher, _ in METRICS]
        acc_a, acc_b = ra.get("acceptance"), rb.get("acceptance")
        flag = _acceptance_flag(name, acc_a, acc_b)
        if flag:
            flags.append(flag)
        if bool(acc_a) != bool(acc_b):
            notes.append(f"{name}: only {'A' if acc_a else 'B'} shows speculative-decoding counters")
        ta, tb = ra.get("tokens"), rb.get("tokens")
        if ta and tb and max(ta, tb) > LENGTH_MISMATCH * min(ta, tb):
            notes.append(f"{name}: A wrote {ta} tokens, B {tb}: the answers differ, so end-to-end tok/s "
                         f"spreads the time to first token over different lengths; decode tok/s compares the engines")
        ratio = (acc_b["mean_acceptance_length"] / acc_a["mean_acceptance_length"]) if acc_a and acc_b else None
        stream = {"stream": ra["stream"]} if ra.get("stream") is not None else {}
        workloads.append({**stream, "workload": ra["workload"], "metrics": rows,
                          "acceptance": {"a": acc_a, "b": acc_b, "ratio": ratio, "flag": flag}})
    out = {"kind": COMPARISON_KIND, "schema_version": SCHEMA_VERSION, "interleaved": interleaved, "concurrency": ca,
           "a": _side(a), "b": _side(b), "workloads": workloads, "flags": flags}
    if ca > 1:
        rows = [_metric_row(key, label, higher, [r[key] for r in a.get("rounds", []) if r.get(key) is not None],
                            [r[key] for r in b.get("rounds", []) if r.get(key) is not None])
                for key, label, higher, _ in AGGREGATE_METRICS]
        acc_a, acc_b = ((x.get("aggregate") or {}).get("acceptance") for x in (a, b))
        flag = _acceptance_flag("all streams (server-wide counters)", acc_a, acc_b)
        if flag:
            flags.append(flag)
        ratio = (acc_b["mean_acceptance_length"] / acc_a["mean_acceptance_length"]) if acc_a and acc_b else None
        out["aggregate"] = {"metrics": rows, "acceptance": {"a": acc_a, "b": acc_b, "ratio": ratio, "flag": flag}}
    out.update({
        "notes": notes + [f"A: {w}" for w in a.get("warnings", [])] + [f"B: {w}" for w in b.get("warnings", [])],
        "rules": {"verdict": f"only when the ranges of the runs do not overlap, with at least "
                             f"{MIN_RUNS_FOR_VERDICT} runs on each side",
                  "low_acceptance": f"accepted tokens per draft below {LOW_ACCEPTANCE_FRACTION} x the other "
                                    f"side's and at least {LOW_ACCEPTANCE_MIN_GAP} lower, over >= {MIN_DRAFTS} "
                                    f"drafts each"},
        "reports": {"a": a, "b": b}})
    return out


def load_report(path) -> dict:
    """A single-server report saved by ``bench --json``/``--out``, checked enough to compare: a
    regular file, read at most ``JSON_CAP`` and nested at most ``MAX_DEPTH`` (``core/bounded_read``)."""
    from hybrid_build.core.bounded_read import read_json

    data = read_json(path, str(path))
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a hybrid-build bench result")
    if data.get("kind") == COMPARISON_KIND:
        raise UserError(f"{path}: holds a comparison; --compare takes two single-server results "
                        f"(bench URL --out FILE)")
    if data.get("kind") != REPORT_KIND or not isinstance(data.get("results"), list):
        if isinstance(data.get("results"), list) and data["results"] and "samples" not in data["results"][0]:
            raise UserError(f"{path}: written by an older hybrid-build bench (no per-run samples); run bench again")
        raise UserError(f"{path}: not a hybrid-build bench result")
    return data


# ---- text ----------------------------------------------------------------------------------------

def _fmt(st: dict | None, factor: float = 1.0, digits: int = 1) -> str:
    if not st:
        return "-"
    f = f"{{:.{digits}f}}"
    mid, lo, hi = (f.format(st[k] * factor) for k in ("median", "min", "max"))
    return mid if st["n"] == 1 else f"{mid} ({lo}-{hi})"


def _acc_cell(acc: dict | None) -> str:
    if not acc:
        return "-"
    rate = acc["draft_acceptance_rate"]
    return f"{acc['mean_acceptance_length']:.2f}" + (f" ({100 * rate:.0f}% of drafts)" if rate is not None else "")


def table(report: dict) -> str:
    """One server's results: median (min-max) of the runs per workload, or per stream."""
    if report.get("concurrency", 1) > 1:
        return _streams_table(report)
    lines = [f"{report['model']} at {report['base_url']}: {report['runs']} runs per workload after a discarded "
             f"warm-up, temperature 0, up to {report['max_tokens']} tokens; median (min-max)",
             f"{'workload':<9} {'tokens':>6}  {'TTFT ms':<22} {'decode tok/s':<22} {'e2e tok/s':<22} acceptance length"]
    for r in report["results"]:
        st = {k: _stats(s[k] for s in r["samples"]) for k in ("ttft_s", "decode_tok_s", "e2e_tok_s")}
        tokens = f"{r['tokens']:.0f}" if r["tokens"] is not None else "-"
        lines.append(f"{r['workload']:<9} {tokens:>6}  {_fmt(st['ttft_s'], 1000):<22} {_fmt(st['decode_tok_s']):<22} "
                     f"{_fmt(st['e2e_tok_s']):<22} {_acc_cell(r.get('acceptance'))}")
    if not report.get("speculative"):
        lines.append("acceptance: no speculative-decoding counters on /metrics (not speculating, or not vLLM)")
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    return "\n".join(lines)


def _streams_table(report: dict) -> str:
    n, agg = report["concurrency"], report["aggregate"]
    width = max(11, *(len(row_name(r)) for r in report["results"]))
    lines = [f"{report['model']} at {report['base_url']}: {n} streams at once, each its own request; "
             f"{report['runs']} rounds after a discarded warm-up round, temperature 0, up to "
             f"{report['max_tokens']} tokens; per stream median (min-max) of the rounds",
             f"{'stream':<{width}} {'tokens':>6}  {'TTFT ms':<20} {'decode tok/s':<20} {'e2e tok/s':<20} "
             f"{'overlap %':<14} acceptance length"]
    for r in report["results"]:
        st = {k: _stats(s[k] for s in r["samples"]) for k in ("ttft_s", "decode_tok_s", "e2e_tok_s", "overlap")}
        tokens = f"{r['tokens']:.0f}" if r["tokens"] is not None else "-"
        lines.append(f"{row_name(r):<{width}} {tokens:>6}  {_fmt(st['ttft_s'], 1000):<20} "
                     f"{_fmt(st['decode_tok_s']):<20} {_fmt(st['e2e_tok_s']):<20} {_fmt(st['overlap'], 100, 0):<14} "
                     f"{_acc_cell(r.get('acceptance'))}")
    rounds = report.get("rounds", [])
    st = {k: _stats(r[k] for r in rounds) for k in ("total_tok_s", "mean_decode_tok_s", "min_decode_tok_s",
                                                     "all_decoding_s")}
    lines.append(f"all streams: {_fmt(st['total_tok_s'])} tok/s in total (completion tokens / round wall time); "
                 f"per-stream decode tok/s mean {_fmt(st['mean_decode_tok_s'])}, min {_fmt(st['min_decode_tok_s'])}")
    ov = agg["overlap"]
    if ov["min"] is not None:
        lines.append(f"overlap: all {n} streams were decoding at once for {_fmt(st['all_decoding_s'], 1000, 0)} ms "
                     f"a round; overlap % is the share of a stream's decode window in that time (lowest "
                     f"{100 * ov['min']:.0f}%, stream {ov['min_stream']})")
    else:
        lines.append("overlap: no stream had a decode window (one token each?)")
    if agg.get("acceptance"):
        lines.append(f"acceptance: {_acc_cell(agg['acceptance'])} over all streams, from the server-wide /metrics "
                     f"counters")
        lines.append(f"acceptance per stream: {agg['acceptance_basis']['text']}")
    else:
        lines.append("acceptance: no speculative-decoding counters on /metrics (not speculating, or not vLLM)")
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    return "\n".join(lines)


def compare_table(comparison: dict) -> str:
    """The A/B per workload (per stream): both figures, the ratio B/A and the verdict; with
    concurrent streams the aggregate per round; flags and notes after."""
    a, b = comparison["a"], comparison["b"]
    n = comparison.get("concurrency", 1)
    how = ("measured interleaved (A, B, A, B...)" if comparison.get("interleaved")
           else "from saved results")
    unit = "workload" if n == 1 else "stream"
    lines = [f"A: {a['model']} at {a['base_url']}" + (f" (from {a['file']})" if a.get("file") else ""),
             f"B: {b['model']} at {b['base_url']}" + (f" (from {b['file']})" if b.get("file") else ""),
             f"{how}; " + (f"{n} streams at once; " if n > 1 else "")
             + f"{a['runs']} / {b['runs']} runs per {unit}; median (min-max); a verdict only where the runs' "
               f"ranges do not overlap"]
    factors = {k: f for k, _, _, f in METRICS + AGGREGATE_METRICS}
    blocks = [(row_name(w), w) for w in comparison["workloads"]]
    if comparison.get("aggregate"):
        blocks.append(("all streams", comparison["aggregate"]))
    width = max([9] + [len(name) for name, _ in blocks])
    for name, w in blocks:
        lines.append("")
        lines.append(f"{name:<{width}} {'':<18} {'A':<24} {'B':<24} {'B/A':>6}  verdict")
        for m in w["metrics"]:
            ratio = f"{m['ratio']:.3f}" if m["ratio"] is not None else "-"
            lines.append(f"{'':<{width}} {m['label']:<18} {_fmt(m['a'], factors[m['metric']]):<24} "
                         f"{_fmt(m['b'], factors[m['metric']]):<24} {ratio:>6}  {m['verdict']}")
        acc = w["acceptance"]
        if acc["a"] or acc["b"]:
            ratio = f"{acc['ratio']:.3f}" if acc["ratio"] is not None else "-"
            lines.append(f"{'':<{width}} {'acceptance length':<18} {_acc_cell(acc['a']):<24} "
                         f"{_acc_cell(acc['b']):<24} {ratio:>6}  "
                         f"{'LOW ACCEPTANCE (flag below)' if acc['flag'] else ''}".rstrip())
    if n > 1:
        lines.append("")
        lines.append("note: a stream's acceptance length is its decode tokens per streamed chunk (the counters "
                     "are server-wide); that of 'all streams' is the counters'")
    if comparison["flags"]:
        lines.append("")
        lines += [f"FLAG {f}" for f in comparison["flags"]]
    if comparison["notes"]:
        lines.append("")
        lines += [f"note: {note}" for note in comparison["notes"]]
    return "\n".join(lines)
