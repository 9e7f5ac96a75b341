"""The paths where serving runtimes break, checked by ``verify`` after the prompt log-probabilities.

The prompt log-probabilities ``verify`` compares with the reference take one path through a server:
one request at a time, prefilled from scratch, never through a drafter. vLLM skips the prefix cache
for every request that asks for them (0.23.0-0.33.0 ``sampling_params.py``,
``SamplingParams.__post_init__``: ``skip_reading_prefix_cache = self.prompt_logprobs is not None``;
``v1/core/kv_cache_manager.py``, ``KVCacheManager.get_computed_blocks``, returns no cached block for
such a request). The paths users' traffic takes are compared here on **generated** tokens' log-
probabilities (``/v1/completions`` with ``logprobs: k``, ``return_tokens_as_token_ids`` so that every
entry is an id, ``ignore_eos`` so that every continuation has its full length, temperature 0):

- **cache**: one prompt of ``cache_tokens`` tokens (the reference texts, cycled; cut to fit the
  served ``max_model_len``) sent cold and then again warm, both under one fresh ``cache_salt``.
  vLLM hashes the salt into the first block's hash (``v1/core/kv_cache_utils.py``,
  ``generate_block_hash_extra_keys``; the completion request carries it in 0.23.0-0.33.0,
  ``CompletionRequest.cache_salt``, through ``renderers/online_renderer.py`` ``preprocess_cmpl``'s
  ``prompt_extras`` in 0.25.1), so the first request cannot hit anything cached before and the
  second hits what the first left. The hit is read from ``/metrics`` (``vllm:prefix_cache_queries``
  and ``vllm:prefix_cache_hits``, tokens, ``PREFIX_QUERIES``): no lookups means caching is off; where the
  profile turns caching on (``PathOptions.prefix_caching``), caching off or a warm run with zero hits
  is a failure. The warm continuation is compared with the cold one.
- **concurrency**: N prompts (the reference texts, each stream its own) each answered alone, then
  all N at once: every connection is opened before any request is sent, so the N arrive together
  and the engine batches them. Each stream's answer is compared with its answer alone.
- **decode**: a greedy continuation of a reference text (through the drafter where one is served:
  the speculative counters on ``/metrics`` say how many drafts it took) and a prefill of the same
  tokens (``prompt_logprobs`` of text + continuation): per generated token, the prefill's
  distribution at that position against the one the decode returned.

Every request outside the cache path has a fresh ``cache_salt``, so none of them hits a cache left
by another. Every answer is checked for shape first (``verify.check_position``).

**Tolerances** (docs/serve.md, "The paths where runtimes break"). Two answers of one server for one
context differ only by floating-point nondeterminism: another batch shape or a cached prefix changes
the order of bf16/fp32 reductions, not the math. Per compared position: KL(base || path) with the tail lumped
(``verify.kl_lumped``) under the recipe's ``verify`` bounds (mean ``max_mean_kl``, p99 ``max_p99_kl``):
a path is broken when its answers differ from the server's own plain answers by more than the main
check lets the server differ from the fp32 reference. The two top-1 tokens must be the same except at
a **near-tie**: each side's log-probability of the other's top-1 within ``logprob_tol`` of its own
top-1's; the chosen token's log-probability must move by at most ``logprob_tol``. ``LOGPROB_TOL`` =
0.25 nats: vLLM's lm-head writes bf16 logits, so a logit in [16, 32) is a multiple of 0.125 and a
different reduction order can move it by one such step; a log-probability difference involves two
logits (the token's and, through the log-sum-exp, the top one's): 2 steps = 0.25. Two continuations
part at a near-tie: they are compared up to that token (its own distributions included), not after.
"""
from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from hybrid_build.core.errors import CannotVerify, ErrorStatus
from hybrid_build.core.http_client import HttpClient, metrics_url

from .verify import Position, Served, check_position, check_prompt, client, exceeds, kl_lumped, p99, prompt_answer
from .verify_options import CACHE_GEN, CACHE_TOKENS, CONCURRENCY, LOGPROB_TOL, PATHS  # noqa: F401

CONCURRENCY_GEN = 16
DECODE_GEN = 32  # a few drafter rounds at 4-12 speculative tokens
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
TOKEN_ID = re.compile(r"token_id:(\d+)")
COUNTER_SETTLE_S = (0.1, 0.2, 0.4)  # re-reads of /metrics when a request's lookups are not counted yet


# vLLM's prefix-cache counters (v1/metrics/loggers.py, PrometheusStatLogger, in 0.23.0, 0.25.1, 0.26.0
# and 0.33.0): tokens looked up in the cache and tokens found there, summed over engines. The
# scheduler counts them in KVCacheManager.get_computed_blocks, which returns before counting for a
# request that skips reading the cache (one asking for prompt log-probabilities) or when caching is
# off: no queries means no lookup happened.
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


class PathCannotRun(CannotVerify):
    """A path could not be checked on this server (no generated log-probabilities, an error status)."""


def prefix_cache_counts(base_url: str, api_key: str | None, timeout: float) -> tuple[float, float] | None:
    """(queries, hits) of the server's prefix cache now, in tokens; None when it serves no
    ``/metrics`` (404) or no such counters (not vLLM, or stats off)."""
    m = client(api_key, timeout).metrics(metrics_url(base_url))
    queries, hits = (None, None) if m is None else (m.counter(PREFIX_QUERIES), m.counter(PREFIX_HITS))
    return None if queries is None or hits is None else (queries, hits)


@dataclass(frozen=True)
class PathOptions:
    skip: frozenset = frozenset()
    concurrency: int = CONCURRENCY
    prefix_caching: bool | None = None  # what the serve profile claims; None: not known
    cache_tokens: int = CACHE_TOKENS
    logprob_tol: float = LOGPROB_TOL


@dataclass
class Generation:
    tokens: list[int]
    positions: list[Position]


@dataclass
class PathResult:
    name: str
    outcome: str = ""  # passed, failed, could not run, skipped
    seconds: float | None = None
    positions: int = 0
    near_ties: int = 0
    kl: list[float] = field(default_factory=list)
    logprob_diff: list[float] = field(default_factory=list)  # |d log-prob| of the token both chose
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    cannot: str = ""

    def reasons(self) -> str:
        return self.cannot or "; ".join(self.notes)

    def figures(self) -> dict:
        n = len(self.kl)
        return {"positions": self.positions, "near_ties": self.near_ties,
                "kl_mean": sum(self.kl) / n if n else None, "kl_p99": p99(self.kl) if n else None,
                "kl_max": max(self.kl) if n else None,
                "logprob_max_abs_diff": max(self.logprob_diff) if self.logprob_diff else None}

    def judge(self, thresholds, tol: float) -> None:
        """The outcome, from what was recorded: a failure anywhere fails; then the bounds, with
        non-finite figures failing (``exceeds``)."""
        if self.outcome in ("skipped", "could not run") and not self.failures:
            return
        f = self.figures()
        if not self.failures:
            if not self.positions:
                self.failures.append("no position compared")
            else:
                if exceeds(f["kl_mean"], thresholds.max_mean_kl):
                    self.failures.append(f"KL mean {f['kl_mean']:.5f} > {thresholds.max_mean_kl}")
                if exceeds(f["kl_p99"], thresholds.max_p99_kl):
                    self.failures.append(f"KL p99 {f['kl_p99']:.5f} > {thresholds.max_p99_kl}")
                if self.logprob_diff and exceeds(f["logprob_max_abs_diff"], tol):
                    self.failures.append(f"the chosen token's log-probability moved by {f['logprob_max_abs_diff']:.4f} "
                                         f"> {tol} nats")
        self.outcome = "failed" if self.failures else "passed"

    def label(self) -> str:
        """The name with what was exercised: the hit, the streams, the drafts."""
        if self.name == "cache":
            hit = self.facts.get("hit_tokens")
            return f"cache (hit {hit:g} tokens)" if hit else "cache (no hit confirmed)"
        if self.name == "concurrency":
            return f"concurrency ({self.facts.get('streams')} at once)"
        drafts = self.facts.get("drafts")
        return "decode" + (f" ({drafts:g} drafts)" if drafts else "")

    def line(self) -> str:
        f = self.figures()
        if self.outcome == "skipped":
            return f"path {self.name:<12} skipped ({self.reasons()})"
        if self.outcome == "could not run":
            return f"path {self.name:<12} could not run: {self.cannot}"
        kl = "-" if f["kl_mean"] is None else f"{f['kl_mean']:.2e}"
        kl99 = "-" if f["kl_p99"] is None else f"{f['kl_p99']:.2e}"
        d = "-" if f["logprob_max_abs_diff"] is None else f"{f['logprob_max_abs_diff']:.4f}"
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"path {self.name:<12} {self.outcome}: {self.label()}, {f['positions']} positions, KL mean {kl}, "
                f"p99 {kl99}, max |d logprob| {d}, near-ties {f['near_ties']}{notes}; {self.seconds:.2f} s")

    def to_json(self) -> dict:
        return {"outcome": self.outcome, "seconds": None if self.seconds is None else round(self.seconds, 3),
                "checked": self.label() if self.outcome in ("passed", "failed") else None, **self.figures(),
                "failures": self.failures, "notes": self.notes, "could_not_run": self.cannot or None, **self.facts}


# ------------------------------------------------------------------------------------ requests


def new_salt() -> str:
    return f"hybrid-build-verify-{uuid.uuid4().hex}"


def generation_body(served: Served, prompt: list[int], n: int, salt: str) -> dict:
    """A greedy continuation with its log-probabilities; every field exists in vLLM 0.23.0-0.33.0's
    CompletionRequest."""
    return {"model": served.model, "prompt": list(prompt), "max_tokens": n, "temperature": 0, "logprobs": served.k,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "cache_salt": salt}


def call(served: Served, body: dict, via: HttpClient | None = None) -> dict:
    """One completion; an error status is this path's "could not run"."""
    try:
        return (via or client(served.api_key, served.timeout)).post_json(served.base + "/completions", body)
    except ErrorStatus as e:
        raise PathCannotRun(str(e)) from None


def _token_id(key) -> int:
    m = TOKEN_ID.fullmatch(str(key))
    if not m:
        raise PathCannotRun(f"the server names generated tokens by text ({str(key)[:40]!r}), not by id "
                            "(return_tokens_as_token_ids is vLLM's)")
    return int(m.group(1))


def parse_generation(served: Served, data, where: str, n: int, res: PathResult) -> Generation | None:
    """The generated tokens and their log-probabilities, each position checked for shape; shape
    violations go to ``res.failures`` and give None."""
    choices = data.get("choices") if isinstance(data, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    lp = choice.get("logprobs")
    if not (isinstance(lp, dict) and isinstance(lp.get("tokens"), list) and isinstance(lp.get("top_logprobs"), list)):
        raise PathCannotRun("the server returned no log-probabilities of the generated tokens")
    tokens, tops = lp["tokens"], lp["top_logprobs"]
    violations: list[str] = []
    if len(tokens) != n or len(tops) != len(tokens):
        violations.append(f"{where}: {len(tokens)} generated tokens with {len(tops)} log-probability lists, {n} "
                          "asked for (ignore_eos)")
    ids, positions = [], []
    for i, (tok, top) in enumerate(zip(tokens, tops)):
        token = _token_id(tok)
        ids.append(token)
        if not isinstance(top, dict) or not top:
            violations.append(f"{where} generated token {i}: no log-probabilities")
            continue
        entries = [(_token_id(key), v if isinstance(v, (int, float)) and not isinstance(v, bool) else None, None)
                   for key, v in top.items()]
        entries = [(t, None if v is None else float(v), r) for t, v, r in entries]
        pos = check_position(f"{where} generated token {i}", entries, served.k, served.vocab, token, violations)
        if pos is not None:
            positions.append(pos)
    res.failures += violations
    return None if violations else Generation(ids, positions)


def generate(served: Served, prompt: list[int], n: int, salt: str, where: str, res: PathResult) -> Generation | None:
    data = call(served, generation_body(served, prompt, n, salt))
    gen = parse_generation(served, data, where, n, res)
    if gen is not None:
        greedy(res, gen, where, res_tol(res))
    return gen


def res_tol(res: PathResult) -> float:
    return res.facts.get("logprob_tol", LOGPROB_TOL)


def greedy(res: PathResult, gen: Generation, where: str, tol: float) -> None:
    """At temperature 0 each generated token is the top-1 of its own distribution (up to a near-tie)."""
    for i, pos in enumerate(gen.positions):
        top = pos.topk[0]
        if pos.token != top and pos.logprobs[top] - pos.actual > tol:
            res.failures.append(f"{where} generated token {i}: {pos.token} (log-prob {pos.actual:.4f}) is not the "
                                f"top-1 {top} ({pos.logprobs[top]:.4f}) of its own distribution at temperature 0")


def near_tie(a: Position, b: Position, tol: float) -> bool:
    """Each side's log-probability of the other's top-1 within ``tol`` of its own top-1's."""
    ta, tb = a.topk[0], b.topk[0]
    return (tb in a.logprobs and a.logprobs[ta] - a.logprobs[tb] <= tol
            and ta in b.logprobs and b.logprobs[tb] - b.logprobs[ta] <= tol)


def compare(res: PathResult, base: list[Position], other: list[Position], where: str, base_name: str,
            follow: bool, tol: float) -> None:
    """``other`` against ``base`` position by position. ``follow``: both are continuations of their
    own, which part where their tokens differ: compared up to that position, not after."""
    for i, (a, b) in enumerate(zip(base, other)):
        res.positions += 1
        res.kl.append(kl_lumped(a.topk, [a.logprobs[j] for j in a.topk], b.logprobs, b.topk))
        ta, tb = a.topk[0], b.topk[0]
        if ta != tb:
            if near_tie(a, b, tol):
                res.near_ties += 1
            else:
                res.failures.append(f"{where} token {i}: top-1 {tb} ({b.logprobs[tb]:.4f}) where {base_name} has {ta} "
                                    f"({a.logprobs[ta]:.4f}): not a near-tie (> {tol} nats)")
        if a.token == b.token:
            res.logprob_diff.append(abs(a.actual - b.actual))
        elif follow:
            res.notes.append(f"{where}: the continuations part at token {i}, compared up to it")
            break


def _settled(served: Served, prev: tuple[float, float] | None, wait: bool) -> tuple[float, float] | None:
    """The prefix-cache counters after a request; re-read a few times while its lookup is not counted
    yet (vLLM counts it in the step that schedules the request and publishes the counters after)."""
    now = prefix_cache_counts(served.base, served.api_key, served.timeout)
    for pause in COUNTER_SETTLE_S if wait else ():
        if now is None or prev is None or now[0] > prev[0]:
            break
        time.sleep(pause)
        now = prefix_cache_counts(served.base, served.api_key, served.timeout)
    return now


def _drafts(served: Served) -> float | None:
    m = client(served.api_key, served.timeout).metrics(metrics_url(served.base))
    return None if m is None else m.counter(SPEC_DRAFTS)


# ------------------------------------------------------------------------------------ the paths


def filler(ref, length: int) -> list[int]:
    """``length`` token ids: the reference texts one after another, cycled."""
    ids = [i for t in ref.texts.values() for i in t.token_ids]
    return (ids * (length // len(ids) + 1))[:length]


def check_cache(served: Served, ref, opts: PathOptions, res: PathResult) -> None:
    n = CACHE_GEN
    length = opts.cache_tokens if not served.max_model_len else min(opts.cache_tokens, served.max_model_len - n - 1)
    prompt, salt, wait = filler(ref, max(length, 2)), new_salt(), opts.prefix_caching is not False
    res.facts.update(prompt_tokens=len(prompt), claimed=opts.prefix_caching)
    before = prefix_cache_counts(served.base, served.api_key, served.timeout)
    cold = generate(served, prompt, n, salt, "cold", res)
    mid = _settled(served, before, wait)
    warm = generate(served, prompt, n, salt, "warm", res)
    after = _settled(served, mid, wait)
    if cold is not None and warm is not None:
        compare(res, cold.positions, warm.positions, "warm", "the cold run", True, opts.logprob_tol)
    if None in (before, mid, after):
        res.facts["hit_tokens"] = None
        if opts.prefix_caching:
            raise PathCannotRun("the profile turns prefix caching on and the server has no prefix-cache counters "
                                f"({metrics_url(served.base)}) to confirm a hit")
        res.notes.append("hit not confirmed: no prefix-cache counters on /metrics")
        return
    (q0, h0), (q1, h1), (q2, h2) = before, mid, after
    res.facts.update(cold_queried_tokens=_count(q1 - q0), cold_hit_tokens=_count(h1 - h0),
                     warm_queried_tokens=_count(q2 - q1), hit_tokens=_count(h2 - h1))
    on = q1 > q0 or q2 > q1
    if h1 > h0:
        res.notes.append(f"the cold run hit {h1 - h0:g} tokens too (other traffic, or cache_salt not honoured)")
    if not on:
        if opts.prefix_caching:
            res.failures.append("the profile turns prefix caching on, and the server looked nothing up in its "
                                "prefix cache (caching off)")
        else:
            res.notes.append("prefix caching off: compared two cold runs")
    elif h2 <= h1:
        if opts.prefix_caching:
            res.failures.append(f"prefix caching on and zero hits: the warm run of the same {len(prompt)}-token prompt "
                                "found nothing cached")
        else:
            res.notes.append(f"caching on, no hit at {len(prompt)} tokens: compared two cold runs")


def _count(x: float) -> int | float:
    """A counter delta: tokens, a whole number (Prometheus writes floats)."""
    return int(x) if float(x).is_integer() else x


def stream_prompts(ref, n: int) -> list[list[int]]:
    """A prompt per stream: the reference texts, each stream its own (rotated where texts run out)."""
    texts = [t.token_ids for t in ref.texts.values()]
    out = []
    for i in range(n):
        ids, r = texts[i % len(texts)], i // len(texts)
        out.append(ids[r % len(ids):] + ids[:r % len(ids)])
    return out


def at_once(served: Served, bodies: list[dict]) -> list[dict]:
    """The bodies sent together, one thread each on a client of their own whose every new connection
    waits at a barrier until all are open: the server has all of them before it answers any."""
    answers: list = [None] * len(bodies)
    errors: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies), timeout=served.timeout)

    def one(i: int) -> None:
        try:
            answers[i] = call(served, bodies[i], via)
        except BaseException as e:  # raised in the caller's thread below
            barrier.abort()  # the others would wait for a connection that never comes
            errors[i] = e

    with HttpClient(api_key=served.api_key, timeout=served.timeout, connections=len(bodies),
                    connected=barrier.wait) as via:
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return answers


def check_concurrency(served: Served, ref, opts: PathOptions, res: PathResult) -> None:
    n, prompts = CONCURRENCY_GEN, stream_prompts(ref, opts.concurrency)
    res.facts["streams"] = len(prompts)
    alone = [generate(served, p, n, new_salt(), f"stream {i} alone", res) for i, p in enumerate(prompts)]
    answers = at_once(served, [generation_body(served, p, n, new_salt()) for p in prompts])
    together = [parse_generation(served, a, f"stream {i} at once", n, res) for i, a in enumerate(answers)]
    for i, (a, b) in enumerate(zip(alone, together)):
        if a is not None and b is not None:
            greedy(res, b, f"stream {i} at once", opts.logprob_tol)
            compare(res, a.positions, b.positions, f"stream {i} at once", "its answer alone", True, opts.logprob_tol)


def check_decode(served: Served, ref, opts: PathOptions, res: PathResult) -> None:
    n = DECODE_GEN
    prompt = max((t.token_ids for t in ref.texts.values()), key=len)
    before = _drafts(served)
    gen = generate(served, prompt, n, new_salt(), "decode", res)
    after = _drafts(served)
    if before is not None and after is not None:
        res.facts["drafts"] = _count(after - before)
    if gen is None:
        return
    full = prompt + gen.tokens
    rows, _ = prompt_answer(served.base, served.model, full, served.k, served.api_key, served.timeout,
                            extra={"cache_salt": new_salt()})
    violations: list[str] = []
    prefill = check_prompt("decode prefill", rows, full, served.k, served.vocab, violations, first=len(prompt))
    res.failures += violations
    if not violations:
        compare(res, prefill, gen.positions, "decode", "the prefill", False, opts.logprob_tol)


CHECKS = {"cache": check_cache, "concurrency": check_concurrency, "decode": check_decode}


def checker(opts: PathOptions):
    """What ``verify.verify_server`` takes as ``paths``: ``run_paths`` with these options."""
    return lambda served, ref, thresholds: run_paths(served, ref, thresholds, opts)


def run_paths(served: Served, ref, thresholds, opts: PathOptions) -> list[PathResult]:
    """Each path in ``PATHS`` not skipped, timed; a path that cannot run says why (its outcome
    "could not run"), the others still run. ``KeyRefused`` passes through."""
    out = []
    for name in PATHS:
        res = PathResult(name, facts={"logprob_tol": opts.logprob_tol})
        out.append(res)
        if name in opts.skip:
            res.outcome, res.notes = "skipped", ["--skip " + name]
            continue
        t0 = time.perf_counter()
        try:
            CHECKS[name](served, ref, opts, res)
        except CannotVerify as e:  # PathCannotRun, a deadline, a broken connection: this path only
            res.outcome, res.cannot = "could not run", str(e).removeprefix("could not verify: ")
        res.seconds = time.perf_counter() - t0
        res.judge(thresholds, opts.logprob_tol)
    return out
