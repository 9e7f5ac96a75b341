"""A small OpenAI-compatible stand-in server (stdlib only) for the launcher and bench tests.

``python standin_server.py --port P [--ready-after S] [--ready-file PATH] [--answer TEXT]
[--exit-after S] [--tokens N] [--token-delay S] [--first-delay S] [--spec-tokens K]
[--accepted A,B,...] [--no-metrics] [--kv-pool-tokens N] [--reference ARTIFACT ...]``: ``/v1/models`` answers 503 until
``--ready-after`` seconds have passed and, with ``--ready-file``, until that file exists (a test
decides when the server is ready, instead of guessing a time); chat completions answer ``--answer``
(non-streaming) or stream
``--tokens`` tokens after ``--first-delay``, one engine step every ``--token-delay``, with a usage
chunk.

``/metrics`` is vLLM's Prometheus exposition (``Engine.render``: the counters, label names and
text format of vLLM 0.23-0.33 with prometheus_client, `_created` series included; a ``vllm``-marked
test renders the same counts through vLLM's own ``SpecDecodingProm`` and compares). With
``--spec-tokens K`` the stand-in speculates as vLLM does: the prefill step gives the first token,
then every step drafts K tokens, accepts the next number of ``--accepted`` (cycled) and emits the
accepted tokens plus the bonus token in one chunk, advancing ``vllm:spec_decode_*`` as it goes.
Without it there are no spec counters, as on a vLLM serving without a speculative config.

``/v1/completions`` with ``--reference ARTIFACT`` answers prompts of token ids as vLLM 0.23-0.33 do,
computed from one ``TokenModel`` (the artifact's reference on its texts' prefixes, ``--side``
hybrid; a fixed pseudo-random distribution seeded by the context elsewhere): ``prompt_logprobs``
(entry 0 null, then per position a dict keyed by token id holding the top-k and the actual token,
each ``{"logprob", "rank", "decoded_token"}``), ``echo`` + ``logprobs: k`` (the same plus the legacy
string-keyed ``top_logprobs``), and greedy continuations with ``logprobs`` (``return_tokens_as_token_ids``,
``ignore_eos``) through a ``PrefixCache`` keyed by ``cache_salt`` whose counts ``/metrics`` shows
(``vllm:prefix_cache_queries``/``_hits``). ``/v1/models`` says ``max_model_len``.

To simulate servers (each knob breaks one thing; all off is a correct server): ``--logprob-noise X``
(kernels that move every log-probability by N(0, X), drawn again for every request), ``--corrupt``
(each position answers another position's distribution: a loader that ignores ``weight_scale_inv``),
``--no-prompt-logprobs`` (null, and only the legacy echo form), ``--legacy-echo`` (``prompt_logprobs``
ignored), ``--fault KIND`` (prompt log-probabilities with a shape fault: nan, inf, positive, missing,
truncated, short-topk, out-of-vocab), ``--cache-fault`` (state: a hit restores the wrong state;
nan: a hit gives NaN; nohit: caching on, nothing ever hits), ``--no-prefix-caching``,
``--batch-fault`` (a request that arrives with company: logits scaled x1.5), ``--decode-fault``
(decode steps after the first read the context one token short), ``--trickle S`` (completion
bodies one byte every S seconds), ``--model NAME``. With ``--control`` the same knobs are set at
run time by ``POST /standin/config`` (a JSON object of ``Knobs.FIELDS``), so that one process serves
many tests. Engine faults, at run time only: ``hold`` (streaming requests stop after their first
token: ``vllm:num_requests_running`` counts them, the token counters freeze, ``/health`` stays 200),
``die`` (``exit0``: vLLM's EngineDeadError line, then status 0; ``heir``: the same, leaving a forked
child in its own session that keeps the listening socket and answers; or a signal name),
``ignore_term`` (SIGTERM does nothing); held requests, streaming or not, get no token. At start,
``--squat`` plays a server serve did not start (a daemon serves the port, the engine never does) and
``--worker`` forks a process-group member that ignores SIGTERM. Streams are chunked, as vLLM's are:
a stand-in that dies mid-answer leaves its client an incomplete body. Whether a request has company
is known without timing (``StandinHTTPServer``). Reading the reference needs torch and safetensors
(the project's venv); the rest is stdlib.

Chat completions stream as vLLM's do: the running ``usage`` in every chunk where the request asks
for ``continuous_usage_stats``, a finish chunk, then ``usage`` with ``prompt_tokens_details.
cached_tokens`` (the prefix cache's hit, keyed by the request's ``cache_salt``). A request with
``tools`` is answered with a streamed ``tool_calls`` call (the first tool offered) where the
prompt's hash falls in the knob ``tool_share``; ``tool_fault`` makes the call name a tool not
offered or carry arguments that are not JSON; ``fail_every`` N answers every N-th chat request
500, with ``fail_message`` as its words where set (``{prompt}``: the request's last message, as a
careless server quotes it). A chat request whose prompt plus ``max_tokens`` is longer than
``--max-model-len`` is refused 400 in vLLM's words (``renderers/params.py``), and ``POST /tokenize``
counts a chat request's prompt tokens as vLLM's does (``{"count", "max_model_len", "tokens"}``; knob
``tokenize`` off: 404, a server without it). ``/metrics`` has ``vllm:kv_cache_usage_perc``: the
prefix cache's blocks over a pool of ``--kv-pool-tokens`` (default 65,536). ``--record PATH``
appends every chat request and what it was answered as a JSON line, for the tests of ``bench
--trace`` to compare with the report.

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
import signal
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

    def __init__(self, model: str = "qwen", spec_tokens: int = 0, accepted: tuple[int, ...] = (1,), cache=None):
        if spec_tokens and any(a < 0 or a > spec_tokens for a in accepted):
            raise ValueError(f"accepted tokens per draft must lie in 0..{spec_tokens}: {accepted}")
        self.model, self.k, self.pattern = model, spec_tokens, tuple(accepted) or (0,)
        self.lock = threading.Lock()
        self.next = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * spec_tokens
        self.prompt_tokens = self.generation_tokens = 0
        self.running = 0  # requests being generated (vllm:num_requests_running)
        self.cache = cache  # a PrefixCache whose counts /metrics shows (vLLM shows them, zero, without one)
        self.pool_tokens = 65536  # the KV pool vllm:kv_cache_usage_perc is a share of
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
            lines.extend(["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
                          "# TYPE process_start_time_seconds gauge",
                          f"process_start_time_seconds {go_float(self.created)}"])
            lines.extend(["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                          "# TYPE vllm:num_requests_running gauge",
                          f"vllm:num_requests_running{{{labels}}} {go_float(self.running)}"])
            used = len(self.cache.keys) * self.cache.block if self.cache is not None else 0
            lines.extend(["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                          "# TYPE vllm:kv_cache_usage_perc gauge",
                          f"vllm:kv_cache_usage_perc{{{labels}}} {go_float(min(1.0, used / self.pool_tokens))}"])
            if self.k:
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [(labels, self.drafts)])
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", [(labels, self.draft_tokens)])
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", [(labels, self.accepted)])
                counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                        [(f'{labels},position="{i}"', v) for i, v in enumerate(self.per_pos)])
            queries, hits = (self.cache.queries, self.cache.hits) if self.cache is not None else (0, 0)
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    [(labels, queries)])
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    [(labels, hits)])
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(labels, self.prompt_tokens)])
            counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    [(labels, self.generation_tokens)])
        return "\n".join(lines) + "\n"


FAULT_AT = 3  # the prompt position a one-position shape fault hits (or the last, in a shorter prompt)
FAULTS = ("nan", "inf", "positive", "missing", "truncated", "short-topk", "out-of-vocab")
CACHE_FAULTS = ("state", "nan", "nohit")


class Dist:
    """One next-token distribution over the whole vocabulary: ``listed`` ids with their
    log-probabilities, every other id ``rest`` each (no higher than the lowest listed one)."""

    def __init__(self, listed: dict[int, float], rest: float):
        self.listed, self.rest = listed, rest

    def lp(self, tid: int) -> float:
        return self.listed.get(tid, self.rest)

    def top(self, k: int) -> list[int]:
        return sorted(self.listed, key=lambda i: -self.listed[i])[:k]

    def noisy(self, rng, x: float, vocab: int) -> "Dist":
        """Every listed logit moved by N(0, x), then the whole vocabulary renormalized: a server's
        kernels (vLLM's log-probabilities are a log_softmax of its logits)."""
        if not x:
            return self
        z = {i: v + rng.gauss(0, x) for i, v in self.listed.items()}
        rest_mass = max(vocab - len(z), 0) * math.exp(self.rest)
        before = sum(math.exp(v) for v in self.listed.values()) + rest_mass  # 1, or a little less (Dist)
        lse = math.log((sum(math.exp(v) for v in z.values()) + rest_mass) / before)
        lps = {i: v - lse for i, v in z.items()}
        return Dist(lps, min(self.rest - lse, min(lps.values())))

    def scaled(self, f: float, vocab: int) -> "Dist":
        """The distribution with every logit times ``f`` (a kernel that applies a wrong scale),
        renormalized over the whole vocabulary."""
        z = {i: f * v for i, v in self.listed.items()}
        rest = f * self.rest
        others = max(vocab - len(z), 0)
        m = max([*z.values(), rest])
        lse = m + math.log(sum(math.exp(v - m) for v in z.values()) + others * math.exp(rest - m))
        return Dist({i: v - lse for i, v in z.items()}, rest - lse)


class TokenModel:
    """The stand-in's language model over token ids: the next-token distribution of any context.

    On a prefix of one of the artifact's reference texts it is the reference's row (``side``: its
    top-k and the token that came next; the rest of the mass spread evenly over the rest of the
    vocabulary); ``corrupt`` answers each reference position with another's row (what a loader that
    ignores ``weight_scale_inv`` gives). On any other context it is a fixed pseudo-random
    distribution seeded by the whole context. Every path that computes one context (a prefill, a
    decode step, a cache hit, a batch) gets one answer from it; a path that computes another
    context (a cache that restores the wrong state, a decode step off by one) gets another."""

    def __init__(self, artifact: str, side: str = "hybrid", corrupt: bool = False, k: int = 20):
        from hybrid_build.validate.reference import read_reference

        self.ref = read_reference(artifact)
        self.side, self.corrupt, self.k = side, corrupt, max(k, self.ref.k)
        self.vocab = self._vocab(artifact)
        self.prefixes: dict[tuple, tuple] = {}
        for text in self.ref.texts.values():
            for t in range(1, len(text.token_ids)):
                self.prefixes.setdefault(tuple(text.token_ids[:t]), (text, t - 1))

    def _vocab(self, artifact: str) -> int:
        try:
            cfg = json.loads(open(os.path.join(artifact, "config.json")).read())
            return int((cfg.get("text_config") or cfg)["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return 1 + max(int(t.top_ids[self.side].max()) for t in self.ref.texts.values())

    def dist(self, context) -> Dist:
        hit = self.prefixes.get(tuple(context))
        if hit is not None:
            text, row = hit
            src = (row + 7) % text.positions if self.corrupt else row
            ids = text.top_ids[self.side][src].tolist()
            lps = text.top_logprobs[self.side][src].tolist()
            listed = dict(zip(ids, lps))
            actual = text.token_ids[row + 1]
            if actual not in listed:
                listed[actual] = min(float(text.target_logprob[self.side][row]), min(lps) - 1e-3)
            mass = sum(math.exp(v) for v in listed.values())
            spread = math.log(max(1.0 - mass, 1e-12) / max(self.vocab - len(listed), 1))
            return Dist(listed, min(spread, min(listed.values())))
        import random

        rng = random.Random(context_key(context))
        n = min(self.k, self.vocab)
        ids = rng.sample(range(self.vocab), n)
        logits = [rng.gauss(0, 2.5) for _ in ids]
        rest = min(logits) - 1.0
        m = max(logits)
        lse = m + math.log(sum(math.exp(v - m) for v in logits) + (self.vocab - n) * math.exp(rest - m))
        return Dist({i: v - lse for i, v in zip(ids, logits)}, rest - lse)


def context_key(context) -> int:
    import zlib
    from array import array

    return zlib.crc32(array("q", context).tobytes())


class PrefixCache:
    """vLLM's prefix cache as the scheduler counts it: full blocks of ``block`` tokens, each keyed by
    its tokens and the previous block's key, the first also by the request's ``cache_salt``
    (``generate_block_hash_extra_keys``); at most ``len - 1`` tokens can hit (the last is recomputed
    for its logits). A request asking for prompt log-probabilities skips it (``SamplingParams``);
    ``queries``/``hits`` count tokens looked up and found (``vllm:prefix_cache_queries``/``_hits``).
    A key is exact, not a hash of the chain: each stored (previous key, block tokens) pair gets its own
    number, so two prompts share a block only where their tokens up to its end are the same."""

    def __init__(self, block: int = 16):
        self.block, self.enabled, self.stores = block, True, True
        self.keys: dict[tuple, int] = {}
        self.lock = threading.Lock()
        self.queries = self.hits = 0

    def _blocks(self, prompt: list[int]):
        for lo in range(0, len(prompt) - len(prompt) % self.block, self.block):
            yield lo + self.block, tuple(prompt[lo:lo + self.block])

    def lookup(self, prompt: list[int], salt) -> int:
        """The tokens of ``prompt`` found cached (counted, as the scheduler counts them)."""
        if not self.enabled:
            return 0
        limit, hit, key = len(prompt) - 1, 0, ("salt", salt)
        with self.lock:
            for end, tokens in self._blocks(prompt):
                key = self.keys.get((key, tokens))
                if end > limit or key is None:
                    break
                hit = end
            self.queries += len(prompt)
            self.hits += hit
        return hit

    def store(self, prompt: list[int], salt) -> None:
        if self.enabled and self.stores:
            with self.lock:
                key = ("salt", salt)
                for _, tokens in self._blocks(prompt):
                    key = self.keys.setdefault((key, tokens), len(self.keys))


class Knobs:
    """How the stand-in misbehaves (all off: a correct server); set by flags, or at run time through
    ``POST /standin/config`` when started with ``--control``."""

    FIELDS = ("model", "noise", "fault", "cache_fault", "prefix_caching", "batch_fault", "decode_fault", "trickle",
              "legacy_echo", "prompt_logprobs", "metrics", "tool_share", "tool_fault", "fail_every",
              "prompt_tokens_details", "hold", "die", "ignore_term", "fail_message", "tokenize")

    def __init__(self, **kw):
        self.model, self.noise, self.fault, self.cache_fault = "qwen", 0.0, None, None
        self.prefix_caching, self.batch_fault, self.decode_fault, self.trickle = True, False, False, 0.0
        self.legacy_echo, self.prompt_logprobs, self.metrics = False, True, True
        # chat: the share of requests with tools answered with a call (chosen by the prompt's hash);
        # tool_fault "name" (a tool not offered) or "args" (arguments not JSON); every fail_every-th
        # chat request answers 500; usage.prompt_tokens_details.cached_tokens (vLLM's
        # --enable-prompt-tokens-details)
        self.tool_share, self.tool_fault, self.fail_every, self.prompt_tokens_details = 0.75, None, 0, True
        self.fail_message, self.tokenize = None, True
        # engine faults: ``hold`` stops every streaming request after its first token (counters
        # frozen, /health 200: a deadlocked engine); ``die`` ends the process at once ("exit0": an
        # EngineDeadError line then status 0, as vLLM's API server does; a signal name: killed by it);
        # ``ignore_term``: SIGTERM does nothing (an engine stuck in a CUDA call)
        self.hold, self.die, self.ignore_term = False, None, False
        self.held = threading.Event()  # set while ``hold`` is off: held requests wait on it
        self.held.set()
        self.update(kw)

    def update(self, kw: dict) -> None:
        for name, value in kw.items():
            if name not in self.FIELDS:
                raise ValueError(f"unknown knob {name!r} (known: {', '.join(self.FIELDS)})")
            setattr(self, name, value)
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault {self.fault!r}: one of {FAULTS}")
        if self.cache_fault is not None and self.cache_fault not in CACHE_FAULTS:
            raise ValueError(f"cache_fault {self.cache_fault!r}: one of {CACHE_FAULTS}")
        if self.die is not None and self.die not in ("exit0", "heir") and not self.die.startswith("SIG"):
            raise ValueError(f"die {self.die!r}: exit0, heir or a signal name")
        if self.hold:
            self.held.clear()
        else:
            self.held.set()

    def to_json(self) -> dict:
        return {n: getattr(self, n) for n in self.FIELDS}


def _shape_fault(rows: list, kind: str, vocab: int, k: int) -> list:
    """The prompt log-probabilities with one shape fault (``nan``: every position sharpened, with one
    NaN among its top-k, the fault that once passed; the others at position ``FAULT_AT``)."""
    rows = [dict(r) if r else r for r in rows]
    at = min(FAULT_AT, len(rows) - 1)
    if kind == "truncated":
        return rows[:-1]
    if kind == "missing":
        rows[at] = None
        return rows
    for t in range(1, len(rows)) if kind == "nan" else (at,):
        row = {i: dict(v) for i, v in rows[t].items()}
        ranked = sorted(row, key=lambda i: row[i]["rank"])
        if kind == "nan":
            for v in row.values():
                v["logprob"] *= 1.2
            row[ranked[1]]["logprob"] = float("nan")
        elif kind == "inf":
            row[ranked[0]]["logprob"] = float("inf")
        elif kind == "positive":
            row[ranked[0]]["logprob"] = 0.5
        elif kind == "short-topk":
            drop = next(i for i in reversed(ranked) if row[i]["rank"] <= k)
            del row[drop]
        elif kind == "out-of-vocab":
            last = next(i for i in reversed(ranked) if row[i]["rank"] <= k)
            row[str(vocab + 5)] = row.pop(last)
        rows[t] = row
    return rows


class Completions:
    """What vLLM's ``/v1/completions`` returns for a prompt of token ids, computed from ``TokenModel``:
    greedy continuations with ``logprobs`` (``return_tokens_as_token_ids``: ids as ``token_id:N``,
    the sampled token first, as vLLM orders them), ``prompt_logprobs`` (entry 0 null, then per
    position the top-k plus the actual token, ``{"logprob", "rank", "decoded_token"}``), ``echo``
    + ``logprobs`` (the same, plus the legacy string-keyed ``top_logprobs``), through a
    ``PrefixCache``. ``batched`` says the request ran while others were in flight."""

    def __init__(self, model: TokenModel, knobs: Knobs, cache: PrefixCache):
        self.model, self.knobs, self.cache = model, knobs, cache
        self.serial = 0
        self.lock = threading.Lock()

    def _dist(self, context, rng, batched: bool, drop: int = 0, off_by_one: bool = False) -> Dist:
        kn = self.knobs
        ctx = context[drop:] if drop else context  # a cache that restored the wrong state: the hit part lost
        if off_by_one and len(ctx) > 1:
            ctx = ctx[:-1]
        d = self.model.dist(ctx).noisy(rng, kn.noise, self.model.vocab)
        return d.scaled(1.5, self.model.vocab) if batched and kn.batch_fault else d

    def _rng(self, context, serial: int):
        import random

        return random.Random(context_key(context) ^ (serial * 2654435761))

    def _prompt_rows(self, prompt: list[int], k: int, serial: int, batched: bool) -> list:
        rows: list = [None]
        for t in range(1, len(prompt)):
            d = self._dist(prompt[:t], self._rng(prompt[:t], serial), batched)
            top = d.top(k)
            row = {str(i): {"logprob": d.lp(i), "rank": r + 1, "decoded_token": f"t{i}"} for r, i in enumerate(top)}
            actual = prompt[t]
            if str(actual) not in row:
                rank = 1 + sum(1 for v in d.listed.values() if v > d.lp(actual))
                row[str(actual)] = {"logprob": d.lp(actual), "rank": max(rank, k + 1), "decoded_token": f"t{actual}"}
            rows.append(row)
        return rows

    def answer(self, req: dict, batched: bool) -> tuple[int, dict]:
        """(HTTP status, body) for one completion request."""
        kn, vocab = self.knobs, self.model.vocab
        prompt = req.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) and 0 <= i < vocab for i in prompt)):
            return 400, {"error": {"message": f"the stand-in takes prompts of token ids below {vocab}", "code": 400}}
        with self.lock:
            self.serial += 1
            serial = self.serial
        k_prompt = None if kn.legacy_echo else req.get("prompt_logprobs")
        if k_prompt is None and req.get("echo"):
            k_prompt = req.get("logprobs")  # what vLLM's CompletionRequest.to_sampling_params does
        salt = req.get("cache_salt")
        hit = 0 if k_prompt is not None else self.cache.lookup(prompt, salt)
        nan_state = hit > 0 and kn.cache_fault == "nan"
        drop = hit if kn.cache_fault == "state" else 0
        n = int(req.get("max_tokens") or 16)
        k_gen = None if req.get("echo") else req.get("logprobs")
        as_ids = bool(req.get("return_tokens_as_token_ids"))
        key = (lambda i: f"token_id:{i}") if as_ids else (lambda i: f"t{i}")
        gen, tokens, token_lps, tops = [], [], [], []
        for i in range(n):
            ctx = prompt + gen
            d = self._dist(ctx, self._rng(ctx, serial), batched, drop, off_by_one=kn.decode_fault and i > 0)
            tok = d.top(1)[0]
            gen.append(tok)
            if k_gen is not None:
                lp = (lambda v: float("nan")) if nan_state else (lambda v: v)
                top = {key(tok): lp(d.lp(tok))}
                top.update({key(j): lp(d.lp(j)) for j in d.top(k_gen) if j != tok})
                tokens.append(key(tok))
                token_lps.append(lp(d.lp(tok)))
                tops.append(top)
        self.cache.store(prompt, salt)
        rows = self._prompt_rows(prompt, k_prompt, serial, batched) if k_prompt else None
        if rows and kn.fault:
            rows = _shape_fault(rows, kn.fault, vocab, k_prompt)
        logprobs = None
        if k_gen is not None:
            logprobs = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                        "text_offset": list(range(len(tokens)))}
        if req.get("echo") and req.get("logprobs"):
            logprobs = {"tokens": [f"t{i}" for i in prompt], "top_logprobs": [None] + [
                {v["decoded_token"]: v["logprob"] for v in row.values()} for row in (rows or [None])[1:] if row]}
        choice = {"index": 0, "text": "".join(f"t{i} " for i in gen), "logprobs": logprobs, "finish_reason": "length",
                  "prompt_logprobs": rows if kn.prompt_logprobs else None, "prompt_token_ids": prompt}
        return 200, {"id": "cmpl-standin", "object": "text_completion", "model": kn.model, "choices": [choice],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}


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


def word_id(word: str) -> int:
    """One word's token id: its UTF-8 bytes read as one number (after a 1 byte, so that leading zero
    bytes count). Two different words never share an id, so two sessions' prompts differ in their
    first block whenever their session words differ (a hash modulo a vocabulary let them collide)."""
    return int.from_bytes(b"\x01" + word.encode(), "big")


def chat_token_ids(body: dict) -> list[int]:
    """The stand-in's tokenizer for chat requests: per message a role token, then one token per
    whitespace-separated word (``word_id``): deterministic, so a resent prefix is the same tokens, as
    a chat template and a tokenizer make it."""
    out: list[int] = []
    for m in body.get("messages") or []:
        out.append(word_id(f"<|{m.get('role')}|>"))
        content = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
        out += [word_id(w) for w in content.split()]
    return out


def tool_call(req: dict, ids: list[int], serial: int, knobs: "Knobs") -> dict | None:
    """The call a chat request with tools is answered with (None: text): where the prompt's hash
    falls in the ``tool_share``, the first tool offered, its first required parameter set; with
    ``tool_fault`` a tool not offered ("name") or arguments that are not JSON ("args")."""
    import zlib

    tools = [t.get("function") or {} for t in req.get("tools") or []]
    if not tools or zlib.crc32(json.dumps(ids).encode()) % 1000 >= knobs.tool_share * 1000:
        return None
    fn = tools[0]
    params = (fn.get("parameters") or {}).get("required") or list(((fn.get("parameters") or {}).get("properties")
                                                                   or {"input": None}))
    args = json.dumps({params[0]: f"standin value {serial}"})
    name = fn.get("name", "")
    if knobs.tool_fault == "name":
        name = "not_offered_" + name
    elif knobs.tool_fault == "args":
        args = args[:-1]
    return {"id": f"call_standin_{serial}", "type": "function", "function": {"name": name, "arguments": args}}


class FakeServer:
    """The stand-in in process, on a fake clock: ``first`` s to the first token, then one engine step
    every ``steps[k % len(steps)]`` s for the k-th chat request, so that runs differ by exactly
    what a test says. ``usage`` adds the usage chunk (and the running count in every chunk where the
    request asks for ``continuous_usage_stats``, as vLLM does); ``metrics`` serves ``/metrics``."""

    def __init__(self, clock: list[float], engine: Engine, tokens: int = 30, first: float | list = 0.3,
                 steps: float | list = 0.02, usage: bool = True, metrics: bool = True,
                 blank: tuple[int, int] = (0, 0), tool_parser: bool = True, cache: "PrefixCache | None" = None,
                 prefill: float = 0.0, max_model_len: int | None = None):
        self.clock, self.engine, self.tokens, self.usage, self.metrics = clock, engine, tokens, usage, metrics
        # with a prefix cache (give the engine the same one, for /metrics), the first token comes
        # ``prefill`` s per prompt token not found in it after ``first``
        self.cache, self.prefill, self.max_model_len = cache, prefill, max_model_len
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
        ids = chat_token_ids(body)
        if self.cache is not None:
            hit = self.cache.lookup(ids, None)
            self.cache.store(ids, None)
            first += self.prefill * (len(ids) - hit)

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
                usage = {"prompt_tokens": len(ids), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n".encode()
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
            card = {"id": server.engine.model}
            if server.max_model_len:
                card["max_model_len"] = server.max_model_len
            return _Body(json.dumps({"data": [card]}).encode())
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


def fork_announced(what: str, new_session: bool = False) -> bool:
    """Fork; the child (``True``) prints ``stand-in: WHAT pid N`` to the log before the parent goes
    on, so that whoever reads the log after the parent's next step finds the line."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        if new_session:
            os.setsid()
        print(f"stand-in: {what} pid {os.getpid()}", flush=True)
        os.write(w, b"1")
        os.close(w)
        return True
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return False


def die(how: str, server=None) -> None:
    """End the process as an engine dies: "exit0" prints vLLM's EngineDeadError line and exits 0
    (what vLLM's API server does after the engine core died, vLLM 48966); a signal name kills it;
    "heir" first forks a child in a session of its own that keeps the listening socket ``server``
    (as a forked worker inherits it) and goes on answering there, then exits 0."""
    if how == "heir":
        if fork_announced("heir", new_session=True):
            server.serve_forever()  # the only thread left after fork: the heir serves from here on
            os._exit(0)
        how = "exit0"
    if how == "exit0":
        print("ERROR [async_llm.py] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
              "See stack trace (above) for the root cause.", flush=True)
        os._exit(0)
    os.kill(os.getpid(), getattr(signal, how))


class _Req:
    """What a fake ``urlopen`` reads of a request (``full_url``, ``data``, ``get_header``), from httpx's."""

    def __init__(self, request):
        self.full_url, self.data = str(request.url), request.content or None
        self._headers = request.headers

    def get_header(self, name: str, default=None):
        return self._headers.get(name, default)

    def has_header(self, name: str) -> bool:
        return name in self._headers


def mock_transport(urlopen):
    """An ``httpx.MockTransport`` over a fake ``urlopen(req, timeout)``: the stand-in in process behind
    ``core/http_client.TRANSPORT`` (a test sets it); a streamed body stays lazy, so the fake clock
    moves as the client reads."""
    import urllib.error

    import httpx

    def handle(request):
        try:
            got = urlopen(_Req(request), None)
        except urllib.error.HTTPError as e:
            body = e.fp.read() if getattr(e, "fp", None) is not None else b""
            return httpx.Response(e.code, content=body)
        except urllib.error.URLError as e:
            raise httpx.ConnectError(str(e.reason), request=request) from None
        return httpx.Response(200, content=iter(got) if got.lines is not None else got.data)

    return httpx.MockTransport(handle)


def use_network(monkeypatch, urlopen) -> None:
    """Every client made after this sends to the fake ``urlopen``."""
    from hybrid_build.core import http_client

    monkeypatch.setattr(http_client, "TRANSPORT", mock_transport(urlopen))


class StandinHTTPServer(ThreadingHTTPServer):
    """Knows whether a request has company: a connection counts from its accept until its handler
    ``release``s it (before the answer's first byte, so that a client's next request, sent after
    the answer, never overlaps its last). A request has company when another is counted or waits
    to be accepted: a client that opens N connections before sending on any gets every one of its
    N requests seen together, whatever the threads' timing."""

    daemon_threads = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.flight = threading.Lock()
        self.in_flight = 0

    def get_request(self):
        with self.flight:
            got = super().get_request()
            self.in_flight += 1
        return got

    def release(self) -> None:
        with self.flight:
            self.in_flight -= 1

    def has_company(self) -> bool:
        import select

        with self.flight:
            waiting = bool(select.select([self.socket], [], [], 0)[0])
            return self.in_flight > 1 or waiting


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
    ap.add_argument("--reference", metavar="ARTIFACT", help="answer /v1/completions (prompt log-probabilities, "
                    "greedy continuations) from this artifact's reference (TokenModel)")
    ap.add_argument("--side", default="hybrid", help="the reference's side to answer with")
    ap.add_argument("--max-model-len", type=int, default=2048, help="what /v1/models says of the model")
    ap.add_argument("--block-size", type=int, default=16, help="the prefix cache's block, in tokens")
    ap.add_argument("--logprob-noise", type=float, default=0.0, help="N(0, X) on every log-probability")
    ap.add_argument("--corrupt", action="store_true", help="answer each position with another's distribution")
    ap.add_argument("--no-prompt-logprobs", action="store_true", help="prompt_logprobs null")
    ap.add_argument("--legacy-echo", action="store_true", help="only echo + logprobs gives prompt log-probabilities")
    ap.add_argument("--fault", choices=FAULTS, help="prompt log-probabilities with this shape fault")
    ap.add_argument("--cache-fault", choices=CACHE_FAULTS, help="a cache hit restores the wrong state (state), NaN "
                    "(nan), or the cache never hits (nohit)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="no prefix cache (no lookups counted)")
    ap.add_argument("--batch-fault", action="store_true", help="a request with company gets its logits scaled x1.5")
    ap.add_argument("--decode-fault", action="store_true", help="decode steps after the first read the context "
                    "without its last token")
    ap.add_argument("--trickle", type=float, default=0.0, metavar="S", help="send completions' bodies one byte "
                    "every S seconds")
    ap.add_argument("--control", action="store_true", help="POST /standin/config sets the knobs at run time")
    ap.add_argument("--record", metavar="PATH", help="append every chat request and its answer to PATH (JSON lines)")
    ap.add_argument("--squat", action="store_true", help="a server serve did not start: fork a daemon (its own "
                    "session, its parent gone) that serves the port, then wait without serving")
    ap.add_argument("--worker", action="store_true", help="fork a worker in this process group that ignores "
                    "SIGTERM and lives until killed (an engine core stuck in a CUDA call)")
    ap.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N",
                    help="log the KV pool as vLLM's engine core does at start (\"GPU KV cache size: N tokens\")")
    a = ap.parse_args()
    knobs = Knobs(model=a.model, noise=a.logprob_noise, fault=a.fault, cache_fault=a.cache_fault,
                  prefix_caching=not a.no_prefix_caching, batch_fault=a.batch_fault, decode_fault=a.decode_fault,
                  trickle=a.trickle, legacy_echo=a.legacy_echo, prompt_logprobs=not a.no_prompt_logprobs)
    cache = PrefixCache(a.block_size)
    completions = Completions(TokenModel(a.reference, a.side, a.corrupt), knobs, cache) if a.reference else None
    engine = Engine(a.model, a.spec_tokens, tuple(int(x) for x in a.accepted.split(",") if x.strip()), cache)
    engine.pool_tokens = a.kv_pool_tokens or engine.pool_tokens
    api_key = os.environ.get("VLLM_API_KEY") or None
    if a.worker and fork_announced("worker"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            signal.pause()
    if a.squat:
        child = os.fork()
        if child == 0:
            os.setsid()
            if not fork_announced("squatter"):
                os._exit(0)  # the daemon's parent ends: init adopts it, outside this engine's tree
        else:
            os.waitpid(child, 0)
            print("stand-in: loading weights (never serves)", flush=True)
            while True:
                signal.pause()
    print("stand-in: loading weights", flush=True)
    if a.kv_pool_tokens is not None:  # vLLM 0.26.0's words (kv_cache_utils.py), before the server answers
        print(f"(EngineCore pid={os.getpid()}) INFO {time.strftime('%m-%d %H:%M:%S')} [kv_cache_utils.py:2177] "
              f"GPU KV cache size: {a.kv_pool_tokens:,} tokens", flush=True)

    def apply_cache_knobs() -> None:
        cache.enabled, cache.stores = knobs.prefix_caching, knobs.cache_fault != "nohit"

    apply_cache_knobs()
    chat_lock, chat_count = threading.Lock(), [0]

    def record(req: dict, serial: int, answer: dict) -> None:
        """One chat request and what it was answered, a JSON line in ``--record`` (tests compare)."""
        if a.record:
            with chat_lock, open(a.record, "a") as f:
                f.write(json.dumps({"serial": serial, "request": req, "answer": answer}) + "\n")

    class Handler(BaseHTTPRequestHandler):
        released = False

        def log_message(self, *args):
            pass

        def release(self) -> None:
            if not self.released:
                self.released = True
                self.server.release()

        def handle(self):
            try:
                super().handle()
            finally:
                self.release()

        def _json(self, code: int, obj: dict, trickle: float = 0.0) -> None:
            body = json.dumps(obj).encode()
            self.release()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not trickle:
                self.wfile.write(body)
                return
            self.wfile.flush()
            for i in range(len(body)):  # a server that holds a client by sending a byte now and then
                time.sleep(trickle)
                try:
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                except OSError:
                    return

        def _refused(self) -> bool:
            """Answer 401 as vLLM does when the request lacks the key; True if it did."""
            if authorized(self.path, self.headers.get("Authorization"), api_key):
                return False
            self._json(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):
            if self._refused():
                return
            if self.path == "/metrics" and not a.no_metrics and knobs.metrics:
                body = engine.render().encode()
                self.release()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path == "/health":  # vLLM's: process flags, not progress (200 while held)
                return self._json(200, {})
            if self.path != "/v1/models":
                return self._json(404, {"error": "not found"})
            if time.monotonic() - START < a.ready_after or (a.ready_file and not os.path.exists(a.ready_file)):
                return self._json(503, {"error": "loading"})
            self._json(200, {"object": "list", "data": [{"id": knobs.model, "object": "model",
                                                         "max_model_len": a.max_model_len}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._refused():
                return
            if self.path == "/standin/config" and a.control:
                try:
                    knobs.update(req)
                except ValueError as e:
                    return self._json(400, {"error": str(e)})
                apply_cache_knobs()
                self._json(200, {k: v for k, v in knobs.to_json().items()})
                self.wfile.flush()
                if knobs.die:
                    die(knobs.die, self.server)
                return
            if self.path == "/tokenize" and knobs.tokenize:  # vLLM's, at the root: a chat request's prompt tokens
                if req.get("model") not in (None, knobs.model):
                    return self._json(404, {"error": {"message": f"The model `{req.get('model')}` does not exist.",
                                                      "type": "NotFoundError", "code": 404}})
                ids = chat_token_ids(req)
                return self._json(200, {"count": len(ids), "max_model_len": a.max_model_len, "tokens": ids,
                                        "token_strs": None})
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                return self._json(404, {"error": "not found"})
            if req.get("model") != knobs.model:
                return self._json(404, {"error": f"model {req.get('model')!r} does not exist"})
            if self.path == "/v1/completions":
                if completions is None:
                    return self._json(400, {"error": "the stand-in answers completions only with --reference"})
                code, body = completions.answer(req, self.server.has_company())
                return self._json(code, body, knobs.trickle)
            if not req.get("stream"):
                knobs.held.wait()  # a held engine answers nothing, however small the request
                message = {"role": "assistant", "content": a.answer}
                return self._json(200, {"choices": [{"index": 0, "message": message}],
                                        "usage": {"completion_tokens": 2}})
            with chat_lock:
                chat_count[0] += 1
                serial = chat_count[0]
            if knobs.fail_every and serial % knobs.fail_every == 0:
                record(req, serial, {"error": 500})
                last = (req.get("messages") or [{}])[-1].get("content")
                words = (knobs.fail_message or "simulated engine error").replace("{prompt}", str(last))
                return self._json(500, {"error": {"message": words, "type": "InternalServerError", "code": 500}})
            ids = chat_token_ids(req)
            n = min(a.tokens, req.get("max_tokens") or a.tokens)
            if len(ids) > a.max_model_len - (req.get("max_tokens") or 0):  # vLLM 0.26's words (renderers/params.py)
                record(req, serial, {"error": 400, "prompt_tokens": len(ids)})
                mt = req.get("max_tokens") or 0
                return self._json(400, {"error": {
                    "message": f"This model's maximum context length is {a.max_model_len} tokens. However, you "
                               f"requested {mt} output tokens and your prompt contains {len(ids)} input tokens, for "
                               f"a total of {len(ids) + mt} tokens. Please reduce the length of the input prompt or "
                               "the number of requested output tokens.",
                    "type": "BadRequestError", "param": "input_tokens", "code": 400}})
            hit = cache.lookup(ids, req.get("cache_salt"))  # counted as vLLM counts it; time does not depend on it
            cache.store(ids, req.get("cache_salt"))
            call = tool_call(req, ids, serial, knobs)
            record(req, serial, {"prompt_tokens": len(ids), "cached_tokens": hit, "completion_tokens": n,
                                 "tool_call": call})
            continuous = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))
            # chunked, as vLLM's server (uvicorn) streams: a server that dies mid-answer leaves the
            # client an incomplete body (an error), where an HTTP/1.0 close would read as the end
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            with engine.lock:
                engine.running += 1
            try:
                self._stream(ids, n, call, hit, continuous)
            finally:
                with engine.lock:
                    engine.running -= 1

        def _stream(self, ids: list[int], n: int, call: dict | None, hit: int, continuous: bool) -> None:
            time.sleep(a.first_delay)
            sent = 0
            for i, tokens in enumerate(engine.run(n, prompt_tokens=len(ids))):
                if i:
                    knobs.held.wait()  # a held engine: the request runs, no token comes
                    time.sleep(a.token_delay)
                if call is not None:  # the call's JSON streams in pieces, one per engine step
                    piece = call["function"]["arguments"][sent * 4:(sent + tokens) * 4]
                    if sent + tokens >= n:
                        piece = call["function"]["arguments"][sent * 4:]
                    fn = {"arguments": piece} | ({"name": call["function"]["name"]} if i == 0 else {})
                    delta = {"tool_calls": [{"index": 0, "function": fn} | ({"id": call["id"], "type": "function"}
                                                                            if i == 0 else {})]}
                else:
                    delta = {"content": "".join(f"t{sent + j} " for j in range(tokens))}
                sent += tokens
                ev = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                if continuous:
                    ev["usage"] = {"prompt_tokens": len(ids), "completion_tokens": sent}
                self._chunk(f"data: {json.dumps(ev)}\n\n".encode())
            usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            if knobs.prompt_tokens_details:
                usage["prompt_tokens_details"] = {"cached_tokens": hit}
            done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if call else "length"}]}
            self._chunk(f"data: {json.dumps(done)}\n\n".encode())
            self._chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def on_term(signum, _frame):
        if not knobs.ignore_term:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    server = StandinHTTPServer(("127.0.0.1", a.port), Handler)
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
