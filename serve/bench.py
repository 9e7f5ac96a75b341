"""Single-stream speed and speculative acceptance of OpenAI-compatible servers, and their A/B.

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

**A/B** (``compare``): per workload and metric, both medians and ranges, the ratio B/A and a verdict
("B faster by x%") only when the two ranges of runs do not overlap (every run of one beat every run
of the other; under no real difference that happens by chance with probability
2 / C(2n, n): 10% at 3 runs each, 2.9% at 4, 0.8% at 5), else "within noise". Two servers measured
in one call are interleaved (A, B, A, B...) so that drift hits both. **Low acceptance**: a side
whose accepted tokens per draft (mean acceptance length - 1) fall below half of the other side's,
and at least 0.25 tokens lower, is flagged: that is the known failure of a build that dropped (or
mangled) the MTP or drafter weights: the drafter keeps proposing and almost nothing lands. The
bonus token is left out of that ratio because it is there even for a useless drafter (a garbage
1-token MTP has length 1.0 against a healthy one's ~1.8: a ratio of 0.56 that would hide it).
"""
from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from hybrid_build.core.errors import ExternalToolError, UserError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
REPORT_KIND = "hybrid-build bench"
COMPARISON_KIND = "hybrid-build bench comparison"

# ---- the workload bank -------------------------------------------------------------------------

_AGENT_SYSTEM = ("You are a coding agent working in a Python repository. Act only through the tools; "
                 "answer every turn with exactly one tool call.")
_AGENT_TOOLS = (
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command in the repository root and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Return the text of a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file of the repository with the given text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                        "glob": {"type": "string", "description": "file filter"}},
                       "required": ["pattern"]}}},
)
_STATS_PY = '''"""Small descriptive statistics."""


def mean(values):
    """Arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


def median(values):
    """Middle value of a non-empty sequence (mean of the two middle values for an even count)."""
    n = len(values)
    mid = n // 2
    if n % 2:
        return values[mid]
    return (values[mid - 1] + values[mid]) / 2


def spread(values):
    """Largest minus smallest value."""
    return max(values) - min(values)
'''
_PYTEST_OUT = ("F                                                                        [100%]\n"
               "FAILED tests/test_stats.py::test_median - assert 1 == 2\n"
               " +  where 1 = median([3, 1, 2])\n1 failed in 0.03s")


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


@dataclass(frozen=True)
class Workload:
    """One chat request of the bank: what the model is asked, and what kind of text it answers with."""
    name: str
    about: str
    messages: tuple
    tools: tuple = ()


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("prose", "an essay: open-ended English, the lowest acceptance", (
        {"role": "user", "content": "Write an essay of about 600 words on the history of tea: where it was first "
                                    "drunk, how it travelled along the trade routes to Japan, India, Persia and "
                                    "Europe, and how it changed the societies that took it up. Write flowing "
                                    "paragraphs, with no headings and no lists."},)),
    Workload("code", "a Python module with tests", (
        {"role": "user", "content": "Write a complete Python module lru_cache.py: a thread-safe LRU cache class "
                                    "with get, put, delete, __len__ and __contains__, type hints and docstrings, "
                                    "followed by unittest test cases for eviction order, updates and concurrent "
                                    "use. Output only the code."},)),
    Workload("counting", "1, 2, 3... up to 1000: the most predictable text, the highest acceptance", (
        {"role": "user", "content": "Count from 1 to 1000 in digits, separated by a comma and a space, with "
                                    "nothing before or after the numbers."},)),
    Workload("agent", "the next turn of a coding agent: a tool call whose JSON carries a whole file", (
        {"role": "system", "content": _AGENT_SYSTEM},
        {"role": "user", "content": "tests/test_stats.py::test_median fails. Find the bug in the package and fix "
                                    "it; keep the other functions as they are."},
        _call("call_1", "run_shell", {"command": "python -m pytest -q tests/test_stats.py::test_median"}),
        {"role": "tool", "tool_call_id": "call_1", "content": _PYTEST_OUT},
        _call("call_2", "read_file", {"path": "stats.py"}),
        {"role": "tool", "tool_call_id": "call_2", "content": _STATS_PY},
    ), _AGENT_TOOLS),
)}


# ---- vLLM's speculative-decoding counters --------------------------------------------------------

# the names vLLM registers (vllm/v1/spec_decode/metrics.py, SpecDecodingProm, 0.23 to 0.33); the
# Prometheus text exposition adds `_total` to each counter's samples. A test reads them from the
# real sources of every supported version.
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_COUNTERS = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, SPEC_ACCEPTED_PER_POS)

# the flag: a side accepting less than LOW_ACCEPTANCE_FRACTION of the other side's tokens per draft,
# and at least LOW_ACCEPTANCE_MIN_GAP fewer (two near-useless drafters do not flag each other),
# measured over at least MIN_DRAFTS drafts on each side
LOW_ACCEPTANCE_FRACTION = 0.5
LOW_ACCEPTANCE_MIN_GAP = 0.25
MIN_DRAFTS = 10
# two sides whose median answer lengths differ by more than this factor get a note
LENGTH_MISMATCH = 1.25
# one server alone: a drafter that lands fewer than this many tokens per draft earns a warning
USELESS_DRAFTER = 0.1
# a verdict needs this many measured runs on each side
MIN_RUNS_FOR_VERDICT = 3


@dataclass(frozen=True)
class SpecCounts:
    """vLLM's speculative-decoding counters (summed over engines), or the difference of two readings."""
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_pos: tuple[float, ...] = ()

    def __sub__(self, other: "SpecCounts") -> "SpecCounts":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0.0,) * (n - len(other.accepted_per_pos))
        return SpecCounts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                          self.accepted_tokens - other.accepted_tokens, tuple(x - y for x, y in zip(a, b)))

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0.0,) * (n - len(other.accepted_per_pos))
        return SpecCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                          self.accepted_tokens + other.accepted_tokens, tuple(x + y for x, y in zip(a, b)))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition: name -> [(labels, value)]. Comments are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall((m.group(2) or "{}")[1:-1])}
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _counter(samples: dict, name: str) -> list[tuple[dict[str, str], float]] | None:
    # a counter's samples are `<name>_total` in the text format; the bare name is accepted too
    return samples.get(name + "_total", samples.get(name))


def spec_counts(text: str) -> SpecCounts | None:
    """vLLM's speculative-decoding counters in a ``/metrics`` text, summed over engines; None when
    the server exposes none (it does not speculate, or it is not vLLM)."""
    samples = parse_prometheus(text)
    found = [_counter(samples, n) for n in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)]
    if any(f is None for f in found):
        return None
    per_pos: dict[int, float] = {}
    for labels, value in _counter(samples, SPEC_ACCEPTED_PER_POS) or []:
        if labels.get("position", "").isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    drafts, draft_tokens, accepted = (sum(v for _, v in f) for f in found)
    return SpecCounts(drafts, draft_tokens, accepted, positions)


def metrics_url(base_url: str) -> str:
    """vLLM serves ``/metrics`` at the server root, beside ``/v1``."""
    parts = urlsplit(base_url.rstrip("/"))
    path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path.rstrip("/") + "/metrics", "", ""))


def read_spec_counts(base_url: str, timeout: float = 30.0) -> SpecCounts | None:
    """The server's speculative-decoding counters now; None when it has no ``/metrics`` or none there."""
    try:
        with urllib.request.urlopen(metrics_url(base_url), timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        log.debug("%s: HTTP %s, no acceptance figures", metrics_url(base_url), e.code)
        return None
    except (urllib.error.URLError, OSError) as e:
        raise ExternalToolError(f"cannot reach {metrics_url(base_url)} ({getattr(e, 'reason', e)})") from e
    return spec_counts(text)


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


def _open(req: urllib.request.Request | str, timeout: float):
    """``urlopen``, with a failure said in one line that names the URL."""
    url = req.full_url if isinstance(req, urllib.request.Request) else req
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            body = e.read().decode("utf-8", "replace").strip().replace("\n", " ")[:300]
        except (OSError, AttributeError, ValueError):
            body = ""
        raise ExternalToolError(f"{url}: HTTP {e.code}" + (f": {body}" if body else "")) from e
    except (urllib.error.URLError, OSError) as e:
        raise ExternalToolError(f"cannot reach {url} ({getattr(e, 'reason', e)})") from e


def first_model(base_url: str, timeout: float = 10.0) -> str:
    with _open(base_url.rstrip("/") + "/models", timeout) as r:
        data = json.loads(r.read().decode())
    return data["data"][0]["id"]


def request_body(workload: Workload, model: str, max_tokens: int, thinking: bool) -> dict:
    body: dict = {"model": model, "messages": list(workload.messages), "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if workload.tools:
        body["tools"] = list(workload.tools)
    if not thinking:
        # Qwen3.5's template thinks first by default: each workload should produce its own kind of text
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def stream_once(base_url: str, model: str, workload: Workload | str, max_tokens: int, thinking: bool = False,
                timeout: float = 600.0) -> RunSample:
    """One streamed chat completion, timed from the request to the first and last token-bearing
    chunks: by the server's running token count where every chunk carries one, else by content."""
    workload = WORKLOADS[workload] if isinstance(workload, str) else workload
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions",
                                 data=json.dumps(request_body(workload, model, max_tokens, thinking)).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    counted: list[tuple[float, int]] = []  # (time, running completion-token count) where it grew
    with _open(req, timeout) as r:
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
                if event.get("choices") and usage_tokens and (not counted or usage_tokens > counted[-1][1]):
                    counted.append((time.perf_counter(), usage_tokens))
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
    if counted:
        (t_first, n_first), (t_last, n_last) = counted[0], counted[-1]
        return RunSample(tokens, t_first - t0, t_end - t0, t_last - t_first, decode_tokens=n_last - n_first)
    if first is None:
        first = last = t_end
    return RunSample(tokens, first - t0, t_end - t0, (last or t_end) - first)


@dataclass
class Server:
    """A server under test: its label in an A/B, its OpenAI base URL and the model it serves."""
    label: str
    base_url: str
    model: str

    def measure(self, workload: Workload, max_tokens: int, thinking: bool) -> RunSample:
        """One request, with vLLM's speculative-decoding counters read just before and just after it."""
        before = read_spec_counts(self.base_url)
        sample = stream_once(self.base_url, self.model, workload, max_tokens, thinking)
        after = read_spec_counts(self.base_url) if before is not None else None
        if before is not None and after is not None:
            d = after - before
            sample.spec = {"drafts": d.drafts, "draft_tokens": d.draft_tokens, "accepted_tokens": d.accepted_tokens,
                           "accepted_per_pos": list(d.accepted_per_pos)}
        return sample


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
        total = SpecCounts(0, 0, 0)
        for sp in specs:
            total = total + SpecCounts(sp["drafts"], sp["draft_tokens"], sp["accepted_tokens"],
                                       tuple(sp["accepted_per_pos"]))
        if total.drafts > 0:
            acceptance = acceptance_of(total)
            lengths = [1 + sp["accepted_tokens"] / sp["drafts"] for sp in specs if sp["drafts"] > 0]
            acceptance["mean_acceptance_length_spread"] = [min(lengths), max(lengths)]
    result["acceptance"] = acceptance
    result["samples"] = [s.to_json() for s in samples]
    return result


def report_warnings(results: list[dict]) -> list[str]:
    """What one server's results alone can say about its drafter."""
    out = []
    for r in results:
        acc = r.get("acceptance")
        if acc and acc["drafts"] >= MIN_DRAFTS and acc["accepted_per_draft"] < USELESS_DRAFTER:
            out.append(f"{r['workload']}: the drafter lands {acc['accepted_per_draft']:.2f} tokens per draft "
                       f"(mean acceptance length {acc['mean_acceptance_length']:.2f}): almost nothing. A build that "
                       f"dropped its MTP or drafter weights does this; `bench --compare` against the source tells.")
    return out


def _report(server: Server, runs: int, max_tokens: int, thinking: bool, samples: dict[str, list[RunSample]]) -> dict:
    results = [summarize(name, s) for name, s in samples.items()]
    return {"kind": REPORT_KIND, "schema_version": SCHEMA_VERSION, "base_url": server.base_url,
            "model": server.model, "runs": runs, "max_tokens": max_tokens, "temperature": 0, "thinking": thinking,
            "speculative": any(r["acceptance"] for r in results), "results": results,
            "warnings": report_warnings(results)}


ProgressFn = Callable[[str, str, int], None]


def run_servers(servers: list[Server], runs: int, max_tokens: int, workloads: list[str] | None = None,
                thinking: bool = False, on_run: ProgressFn | None = None) -> list[dict]:
    """The bank on every server, interleaved: per workload one discarded warm-up on each, then
    A, B, A, B... Returns one report per server."""
    names = workloads or list(WORKLOADS)
    samples: dict[str, dict[str, list[RunSample]]] = {s.label: {n: [] for n in names} for s in servers}
    for name in names:
        w = WORKLOADS[name]
        for s in servers:
            stream_once(s.base_url, s.model, w, max_tokens, thinking)  # warm-up, discarded
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


def bench(base_url: str, model: str | None = None, runs: int = 5, max_tokens: int = 256,
          workloads: list[str] | None = None, thinking: bool = False, on_run: ProgressFn | None = None) -> dict:
    """One server's report."""
    server = Server("A", base_url, model or first_model(base_url))
    return run_servers([server], runs, max_tokens, workloads, thinking, on_run)[0]


def bench_pair(url_a: str, url_b: str, model: str | None = None, runs: int = 5, max_tokens: int = 256,
               workloads: list[str] | None = None, thinking: bool = False,
               on_run: ProgressFn | None = None) -> dict:
    """Two servers measured interleaved, and their comparison (which holds both reports)."""
    servers = [Server("A", url_a, model or first_model(url_a)), Server("B", url_b, model or first_model(url_b))]
    a, b = run_servers(servers, runs, max_tokens, workloads, thinking, on_run)
    return compare(a, b, interleaved=True)


# ---- A/B -----------------------------------------------------------------------------------------

# (key in a sample, what the table calls it, higher is better, factor for the table)
METRICS = (("decode_tok_s", "decode tok/s", True, 1.0), ("e2e_tok_s", "e2e tok/s", True, 1.0),
           ("ttft_s", "TTFT ms", False, 1000.0))


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
    return {k: report.get(k) for k in ("base_url", "model", "runs", "max_tokens", "thinking", "file")}


def compare(a: dict, b: dict, interleaved: bool = False) -> dict:
    """The A/B of two reports: per workload the three speed figures with verdicts, the acceptance,
    and the low-acceptance flags. Holds both reports under ``reports``."""
    notes = []
    for key in ("max_tokens", "thinking"):
        if a.get(key) != b.get(key):
            notes.append(f"A and B ran with different {key} ({a.get(key)} vs {b.get(key)}): not like for like")
    by_name = {r["workload"]: r for r in b["results"]}
    a_names = [r["workload"] for r in a["results"]]
    for side, names in (("A", [n for n in a_names if n not in by_name]), ("B", [n for n in by_name if n not in a_names])):
        if names:
            notes.append(f"only {side} ran {', '.join(names)}: left out")
    workloads, flags = [], []
    for ra in a["results"]:
        rb = by_name.get(ra["workload"])
        if rb is None:
            continue
        rows = []
        for key, label, higher, _ in METRICS:
            sa = [s[key] for s in ra["samples"] if s.get(key) is not None]
            sb = [s[key] for s in rb["samples"] if s.get(key) is not None]
            st_a, st_b = _stats(sa), _stats(sb)
            text, significant = verdict(sa, sb, higher) if sa and sb else ("no data", False)
            rows.append({"metric": key, "label": label, "a": st_a, "b": st_b,
                         "ratio": st_b["median"] / st_a["median"] if st_a and st_b and st_a["median"] else None,
                         "verdict": text, "significant": significant})
        acc_a, acc_b = ra.get("acceptance"), rb.get("acceptance")
        flag = None
        for low, ref, low_acc, ref_acc in (("B", "A", acc_b, acc_a), ("A", "B", acc_a, acc_b)):
            if low_acceptance(ref_acc, low_acc):
                flag = (f"{ra['workload']}: {low} lands {low_acc['accepted_per_draft']:.2f} drafted tokens per step "
                        f"(mean acceptance length {low_acc['mean_acceptance_length']:.2f}) against {ref}'s "
                        f"{ref_acc['accepted_per_draft']:.2f} ({ref_acc['mean_acceptance_length']:.2f}): below "
                        f"{LOW_ACCEPTANCE_FRACTION:.0%} of it. This is the known failure of a build that dropped its "
                        f"MTP or drafter weights.")
                flags.append(flag)
        if bool(acc_a) != bool(acc_b):
            notes.append(f"{ra['workload']}: only {'A' if acc_a else 'B'} shows speculative-decoding counters")
        ta, tb = ra.get("tokens"), rb.get("tokens")
        if ta and tb and max(ta, tb) > LENGTH_MISMATCH * min(ta, tb):
            notes.append(f"{ra['workload']}: A wrote {ta} tokens, B {tb}: the answers differ, so end-to-end tok/s "
                         f"spreads the time to first token over different lengths; decode tok/s compares the engines")
        ratio = (acc_b["mean_acceptance_length"] / acc_a["mean_acceptance_length"]) if acc_a and acc_b else None
        workloads.append({"workload": ra["workload"], "metrics": rows,
                          "acceptance": {"a": acc_a, "b": acc_b, "ratio": ratio, "flag": flag}})
    return {"kind": COMPARISON_KIND, "schema_version": SCHEMA_VERSION, "interleaved": interleaved,
            "a": _side(a), "b": _side(b), "workloads": workloads, "flags": flags,
            "notes": notes + [f"A: {w}" for w in a.get("warnings", [])] + [f"B: {w}" for w in b.get("warnings", [])],
            "rules": {"verdict": f"only when the ranges of the runs do not overlap, with at least "
                                 f"{MIN_RUNS_FOR_VERDICT} runs on each side",
                      "low_acceptance": f"accepted tokens per draft below {LOW_ACCEPTANCE_FRACTION} x the other "
                                        f"side's and at least {LOW_ACCEPTANCE_MIN_GAP} lower, over >= {MIN_DRAFTS} "
                                        f"drafts each"},
            "reports": {"a": a, "b": b}}


def load_report(path, text: str) -> dict:
    """A single-server report saved by ``bench --json``/``--out``, checked enough to compare."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e.msg}, line {e.lineno})")
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
    """One server's results: median (min-max) of the runs per workload."""
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


def compare_table(comparison: dict) -> str:
    """The A/B per workload: both figures, the ratio B/A and the verdict; flags and notes after."""
    a, b = comparison["a"], comparison["b"]
    how = ("measured interleaved (A, B, A, B...)" if comparison.get("interleaved")
           else "from saved results")
    lines = [f"A: {a['model']} at {a['base_url']}" + (f" (from {a['file']})" if a.get("file") else ""),
             f"B: {b['model']} at {b['base_url']}" + (f" (from {b['file']})" if b.get("file") else ""),
             f"{how}; {a['runs']} / {b['runs']} runs per workload; median (min-max); a verdict only where the runs' "
             f"ranges do not overlap"]
    for w in comparison["workloads"]:
        lines.append("")
        lines.append(f"{w['workload']:<9} {'':<18} {'A':<24} {'B':<24} {'B/A':>6}  verdict")
        for m in w["metrics"]:
            factor = dict((k, f) for k, _, _, f in METRICS)[m["metric"]]
            ratio = f"{m['ratio']:.3f}" if m["ratio"] is not None else "-"
            lines.append(f"{'':<9} {m['label']:<18} {_fmt(m['a'], factor):<24} {_fmt(m['b'], factor):<24} "
                         f"{ratio:>6}  {m['verdict']}")
        acc = w["acceptance"]
        if acc["a"] or acc["b"]:
            ratio = f"{acc['ratio']:.3f}" if acc["ratio"] is not None else "-"
            lines.append(f"{'':<9} {'acceptance length':<18} {_acc_cell(acc['a']):<24} {_acc_cell(acc['b']):<24} "
                         f"{ratio:>6}  {'LOW ACCEPTANCE (flag below)' if acc['flag'] else ''}".rstrip())
    if comparison["flags"]:
        lines.append("")
        lines += [f"FLAG {f}" for f in comparison["flags"]]
    if comparison["notes"]:
        lines.append("")
        lines += [f"note: {n}" for n in comparison["notes"]]
    return "\n".join(lines)
