"""Check a running OpenAI-compatible server against the artifact's reference (``validate/reference.py``).

The server is asked, per reference text, for the prompt log-probabilities of the text's token ids
(``/v1/completions``: ``prompt_logprobs: k``, else ``echo`` + ``logprobs: k``, whose id-keyed
``prompt_logprobs`` vLLM 0.23-0.33 also return). Per position its answer is compared with the
reference's top-k: a KL estimate, whether the top-1 token is the same, and how far the actual
token's log-probability moved. The verdict takes the recipe's ``verify`` thresholds.

**The KL figure is a lower bound.** Both sides are known only on a few tokens, so the vocabulary is
partitioned into the reference's top-k tokens and one bucket for the rest (the tail): P is the
reference on that partition (tail = 1 - the top-k's mass), Q the server's. A reference top-k token
the server did not return has an unknown server probability, at most that of the server's k-th
token; the tail holds at least the mass of the tokens the server returned outside the reference's
top-k. Among all server distributions consistent with what it returned, the estimate takes the one
with the least KL on the partition (``kl_lumped``). The server's true distribution is one of them,
and KL on a coarser partition never exceeds KL on the full vocabulary (data-processing inequality):
estimate <= KL(P||Q) over the full vocabulary. It is exact when the server returns the reference's
top-k set and the tail is a single token.

**Shape before statistics.** Every answer is checked before any figure is computed from it: each
position of each text answered, every log-probability a finite number <= 0 (``LOGPROB_SLACK``), the
probabilities of one position summing to at most 1, the top-k of the size asked plus the token that
came next, every token id inside the artifact's vocabulary, and the served model one the artifact's
recipe names. One violation fails the check, named by text and position, and no statistic is
computed; the thresholds are tested so that a figure that is not finite fails (``exceeds``), never
with a comparison that NaN makes false.

Then the paths where runtimes break (``verify_paths``): a prefix-cache hit, requests at once, the
decode path (through the drafter where one is served).

Outcomes: ``passed``, ``failed`` and ``could not run`` (a path that could not run, for a
``VerifyReport``), or ``CannotVerify`` (exit 3, one line): nothing answers, the model asked for is
not served, no prompt log-probabilities, no reference, a request past its deadline (``--timeout``
bounds each whole request: ``core/http_client``), an answer the protocol does not allow (HTML, not
JSON, cut off, too large, not UTF-8, nested too deep, a ``/metrics`` that is not Prometheus text).
A redirect is not followed (``RedirectRefused``, exit 2: give the server's own URL). A server that
refuses the API key (none, or another: HTTP 401/403) is ``KeyRefused``, a usage mistake (exit 2, one
line)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hybrid_build.core.api_key import client_key
from hybrid_build.core.bounded_read import InputRefused, read_json
from hybrid_build.core.errors import CannotVerify, ErrorStatus, HybridBuildError, UserError
from hybrid_build.core.http_client import HttpClient, one_line, shared_client
from hybrid_build.recipes.schema import VerifySpec

KIND = "hybrid-build verify"
SCHEMA_VERSION = 2  # 2: "violations", "paths", "vocab_size"; "could not run" as an outcome
SIDES = ("hybrid", "source")
KL_NOTE = ("KL(reference || server) on the reference's top-{k} tokens with the rest lumped into one bucket: a lower "
           "bound of the full-vocabulary KL (data-processing inequality)")
_TINY = 1e-300  # a probability the log can take: a server that gives a token no mass gets a huge, finite term


# ------------------------------------------------------------------------------------ the estimate


def _solve_lambda(p_missing: list[float], cap: float, p_tail: float, tail_floor: float, budget: float) -> float:
    """The lambda at which sum(min(cap, p/lambda)) + max(tail_floor, p_tail/lambda) = budget (it decreases
    in lambda), by bisection in log space."""
    def total(log_lam: float) -> float:
        lam = math.exp(log_lam)
        return sum(min(cap, p / lam) for p in p_missing) + max(tail_floor, p_tail / lam)

    lo, hi = -700.0, 700.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if total(mid) > budget:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def kl_lumped(ref_ids: list[int], ref_logprobs: list[float], server: dict[int, float], server_topk: list[int]) -> float:
    """KL(P || Q) on the partition {each of the reference's top-k tokens} + {the rest}, minimised over the
    server distributions consistent with its answer (module docstring): a lower bound of the full KL.

    ``server`` maps every token id the server returned to its log-probability; ``server_topk`` are its
    top-k ids (the actual token it may add is not one of them unless ranked). A reference token the
    server did not return gets probability min(cap, p/lambda) with cap = the server's k-th probability;
    the tail max(the mass the server returned outside the reference's top-k, p_tail/lambda); lambda
    makes Q sum to 1. That assignment is the minimiser: KL is convex and, where no bound binds, the
    free buckets keep the reference's proportions."""
    p = [math.exp(lp) for lp in ref_logprobs]
    p_tail = max(0.0, 1.0 - sum(p))
    ref_set = set(ref_ids)
    known = [(pi, math.exp(server[i])) for i, pi in zip(ref_ids, p) if i in server]
    missing = [pi for i, pi in zip(ref_ids, p) if i not in server]
    outside = sum(math.exp(lp) for i, lp in server.items() if i not in ref_set)
    budget = max(0.0, 1.0 - sum(q for _, q in known))  # what the missing tokens and the tail share
    kl = sum(pi * math.log(pi / max(q, _TINY)) for pi, q in known if pi > 0)
    if not missing:
        q_tail = max(budget, outside)
        return kl + (p_tail * math.log(p_tail / max(q_tail, _TINY)) if p_tail > 0 else 0.0)
    cap = min(math.exp(server[i]) for i in server_topk) if server_topk else 1.0
    # every missing token at its cap, the tail takes the rest
    if p_tail == 0 and len(missing) * cap + outside <= budget:
        q_missing, q_tail = [cap] * len(missing), budget - len(missing) * cap
    else:
        lam = _solve_lambda(missing, cap, p_tail, outside, max(budget, outside))
        q_missing, q_tail = [min(cap, pi / lam) for pi in missing], max(outside, p_tail / lam)
    kl += sum(pi * math.log(pi / max(q, _TINY)) for pi, q in zip(missing, q_missing) if pi > 0)
    return kl + (p_tail * math.log(p_tail / max(q_tail, _TINY)) if p_tail > 0 else 0.0)


# ------------------------------------------------------------------------------------ the answers' shape

# A log-probability is logit - logsumexp(logits) <= 0. Computed in float32 (vLLM takes log_softmax of
# the logits in float32), a value can exceed 0 only by the rounding of that difference: at most one
# float32 ulp of a logit, 7.6e-6 for logits below 128 in magnitude. Anything above this is no
# log-probability.
LOGPROB_SLACK = 1e-5
# Probabilities of distinct tokens sum to at most 1: k terms, each within LOGPROB_SLACK of exact.
MASS_SLACK = 1e-4
SHOWN = 10  # violations named in the verdict line; the JSON lists them all


@dataclass
class Position:
    """The server's answer at one position: every returned id's log-probability, its top-k ids in
    rank order, the token that came next (``token``) and its log-probability (``actual``)."""

    logprobs: dict[int, float]
    topk: list[int]
    actual: float
    token: int = -1


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def check_position(where: str, entries: list[tuple[int, float | None, int | None]], k: int, vocab: int | None,
                   token: int, violations: list[str]) -> Position | None:
    """One position's (id, log-probability, rank) entries checked for shape: finite log-probabilities
    <= 0 that sum to at most probability 1, ids inside the vocabulary, the top-k of the requested size
    plus the next token. Each violation goes to ``violations`` prefixed with ``where``; the Position
    only when there is none."""
    bad: list[str] = []
    for tid, lp, _ in entries:
        if vocab is not None and not 0 <= tid < vocab:
            bad.append(f"token id {tid} outside the vocabulary of {vocab}")
        if lp is None:
            bad.append(f"token {tid}'s log-probability is not a number")
        elif not math.isfinite(lp):
            bad.append(f"token {tid}'s log-probability is {lp}")
        elif lp > LOGPROB_SLACK:
            bad.append(f"token {tid}'s log-probability {lp:.6g} is above 0")
    ids = [tid for tid, _, _ in entries]
    if len(set(ids)) != len(ids):
        bad.append("a token id listed twice")
    want = min(k, vocab) if vocab else k
    # the top-k plus the next token, once if it is among them: its rank says so where there are ranks
    # (vLLM's prompt log-probabilities), else the count does (k entries: among them; k + 1: not)
    rank = next((r for tid, _, r in entries if tid == token), None)
    others = len(entries) - (1 if token in ids else 0)
    among = rank <= k if rank is not None else len(entries) == want
    top_n = others + (1 if among and others < want else 0)
    if top_n != want:
        bad.append(f"{top_n} top log-probabilities where {k} were asked for")
    if token not in ids:
        bad.append(f"no log-probability for the token that came next ({token})")
    if not bad:
        mass = sum(math.exp(lp) for _, lp, _ in entries)
        if mass > 1 + MASS_SLACK:
            bad.append(f"the log-probabilities sum to probability {mass:.6f} > 1")
    violations.extend(f"{where}: {b}" for b in bad)
    if bad:
        return None
    logprobs = {tid: lp for tid, lp, _ in entries}
    topk = [tid for tid in ids if tid != token or (among and others < want)]
    return Position(logprobs, sorted(topk, key=lambda i: -logprobs[i]), logprobs[token], token)


def prompt_row_entries(row) -> list[tuple[int, float | None, int | None]] | str:
    """A ``prompt_logprobs`` row (``{"<id>": {"logprob", "rank", ...}}``) as entries, or what is wrong."""
    if not isinstance(row, dict) or not row:
        return "no log-probabilities"
    out = []
    for key, v in row.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            return f"token id {key!r} is not an integer"
        if not isinstance(v, dict) or "logprob" not in v:
            return f"token {tid} has no logprob field"
        rank = v.get("rank")
        out.append((tid, _number(v["logprob"]), rank if isinstance(rank, int) and not isinstance(rank, bool) else None))
    return out


def check_prompt(name: str, rows, token_ids: list[int], k: int, vocab: int | None,
                 violations: list[str], first: int = 1) -> list[Position]:
    """The positions ``first..`` of one prompt's ``prompt_logprobs`` (entry 0 is null), checked;
    each violation names the text (``name``) and the position."""
    out: list[Position] = []
    if len(rows) != len(token_ids):
        violations.append(f"{name}: {len(rows)} prompt positions answered, {len(token_ids)} sent "
                          f"(every position must be)")
    for t in range(first, len(token_ids)):
        where = f"{name} position {t}"
        entries = prompt_row_entries(rows[t]) if t < len(rows) else "missing"
        if isinstance(entries, str):
            violations.append(f"{where}: {entries}")
            continue
        pos = check_position(where, entries, k, vocab, token_ids[t], violations)
        if pos is not None:
            out.append(pos)
    return out


# ------------------------------------------------------------------------------------ the server


def client(api_key: str | None, timeout: float) -> HttpClient:
    """The process's pooled client for this key and deadline (``verify`` and ``serve``'s check)."""
    return shared_client(api_key, timeout)


def served_models(base_url: str, api_key: str | None, timeout: float) -> dict[str, dict]:
    """The models the server lists, by id, each with what it says of itself (vLLM: ``max_model_len``)."""
    url = base_url + "/models"
    try:
        data = client(api_key, timeout).get_json(url)
    except ErrorStatus as e:
        raise CannotVerify(f"could not verify: {e}") from None
    try:
        return {str(m["id"]): m for m in data["data"] if isinstance(m, dict)}
    except (KeyError, TypeError):
        raise CannotVerify(f"could not verify: {url} answered no model list") from None


# the request fields sent, in the order tried (each exists in vLLM 0.23.0, 0.25.1 and 0.33.0's
# CompletionRequest; with echo those versions compute prompt_logprobs = logprobs and return them id-keyed)
PROTOCOLS: dict[str, dict] = {
    "prompt_logprobs": {"max_tokens": 1, "temperature": 0},
    "echo": {"echo": True, "max_tokens": 1, "temperature": 0},
}


def request_body(protocol: str, model: str, token_ids: list[int], k: int) -> dict:
    body = {"model": model, "prompt": list(token_ids), **PROTOCOLS[protocol]}
    body["prompt_logprobs" if protocol == "prompt_logprobs" else "logprobs"] = k
    return body


def prompt_answer(base_url: str, model: str, token_ids: list[int], k: int, api_key: str | None = None,
                  timeout: float = 120.0, protocols: tuple[str, ...] = tuple(PROTOCOLS),
                  extra: dict | None = None) -> tuple[list, str]:
    """The server's raw ``prompt_logprobs`` rows for ``token_ids`` and the protocol that gave them: the
    first protocol whose answer holds a list of them (checked by the caller, never here: an answer
    with NaN is an answer, not a missing feature)."""
    url, tried = base_url + "/completions", []
    for protocol in protocols:
        try:
            data = client(api_key, timeout).post_json(url, {**request_body(protocol, model, token_ids, k),
                                                            **(extra or {})})
        except ErrorStatus as e:
            tried.append(f"{protocol}: HTTP {e.status}" + (f": {e.detail}" if e.detail else ""))
            continue
        choices = data.get("choices") if isinstance(data, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        rows = choice.get("prompt_logprobs")
        if isinstance(rows, list) and rows:
            return rows, protocol
        legacy = bool((choice.get("logprobs") or {}).get("top_logprobs")) if isinstance(choice.get("logprobs"), dict) \
            else False
        tried.append(f"{protocol}: " + ("only string-keyed top_logprobs (ids that decode alike collapse)" if legacy
                                        else "no id-keyed prompt_logprobs"))
    raise CannotVerify(f"could not verify: {url} returned no prompt log-probabilities ({'; '.join(tried)})")


@dataclass(frozen=True)
class Served:
    """The server checked, as every request needs it (the paths' checks take it: ``verify_paths``)."""

    base: str
    model: str
    api_key: str | None
    timeout: float
    k: int
    vocab: int | None
    max_model_len: int | None = None


def vocab_size_of(artifact: Path) -> int | None:
    """The artifact's vocabulary size (``config.json``, the text config's where it has one)."""
    try:
        cfg = read_json(Path(artifact) / "config.json", "config.json")
    except (OSError, InputRefused):
        return None
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    v = tc.get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# ------------------------------------------------------------------------------------ the figures


def p99(values: list[float]) -> float:
    """The 99th percentile, linear between order statistics (numpy's default)."""
    s = sorted(values)
    x = 0.99 * (len(s) - 1)
    lo = int(math.floor(x))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def exceeds(value: float | None, bound: float) -> bool:
    """True unless ``value`` is a finite number at most ``bound``: NaN, inf and None exceed every bound
    (a comparison with NaN is false, so ``value > bound`` alone would let NaN through)."""
    return not (value is not None and math.isfinite(value) and value <= bound)


def falls_short(value: float | None, bound: float) -> bool:
    """True unless ``value`` is a finite number at least ``bound`` (NaN and None fall short)."""
    return not (value is not None and math.isfinite(value) and value >= bound)


@dataclass
class Figures:
    """Per-position results of one text (or all of them)."""

    name: str
    kl: list[float] = field(default_factory=list)
    same_top1: list[bool] = field(default_factory=list)
    target_diff: list[float] = field(default_factory=list)
    kl_other: list[float] = field(default_factory=list)  # against the reference's other side, for information

    def extend(self, other: "Figures") -> None:
        self.kl += other.kl
        self.same_top1 += other.same_top1
        self.target_diff += other.target_diff
        self.kl_other += other.kl_other

    def to_json(self) -> dict:
        n = len(self.kl)
        if not n:
            return {"name": self.name, "positions": 0, "kl_mean": None, "kl_p99": None, "kl_max": None,
                    "same_top1": None, "target_logprob_mean_abs_diff": None, "kl_other_side_mean": None}
        return {"name": self.name, "positions": n, "kl_mean": sum(self.kl) / n, "kl_p99": p99(self.kl),
                "kl_max": max(self.kl), "same_top1": sum(self.same_top1) / n,
                "target_logprob_mean_abs_diff": sum(self.target_diff) / n,
                "kl_other_side_mean": sum(self.kl_other) / n}


def compare_text(text, side: str, answer: list[Position]) -> Figures:
    """One text's figures against the reference's ``side`` (``reference.TextReference``); ``answer``
    holds every position, each checked for shape (``check_prompt``)."""
    other = next(s for s in SIDES if s != side)
    fig = Figures(text.name)
    ids, lps = text.top_ids[side].tolist(), text.top_logprobs[side].tolist()
    targets = text.target_logprob[side].tolist()
    o_ids, o_lps = text.top_ids[other].tolist(), text.top_logprobs[other].tolist()
    for row, pos in enumerate(answer):
        fig.kl.append(kl_lumped(ids[row], lps[row], pos.logprobs, pos.topk))
        fig.kl_other.append(kl_lumped(o_ids[row], o_lps[row], pos.logprobs, pos.topk))
        fig.same_top1.append(bool(pos.topk) and pos.topk[0] == ids[row][0])
        fig.target_diff.append(abs(pos.actual - targets[row]))
    return fig


def _some(items: list[str], n: int) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


@dataclass
class VerifyReport:
    url: str
    model: str
    side: str
    k: int
    protocol: str
    thresholds: VerifySpec
    texts: list[Figures]
    artifact: dict
    violations: list[str] = field(default_factory=list)  # answers that are not log-probabilities of the shape asked
    model_mismatch: str | None = None  # the server serves another model than the artifact's
    paths: list = field(default_factory=list)  # verify_paths.PathResult, in the order run
    vocab_size: int | None = None

    @property
    def overall(self) -> Figures:
        whole = Figures("all")
        for t in self.texts:
            whole.extend(t)
        return whole

    @property
    def statistic_failures(self) -> list[str]:
        """The thresholds, on answers that passed their shape check; a figure that is not finite fails."""
        if self.violations or self.model_mismatch:
            return []
        o, th = self.overall.to_json(), self.thresholds
        if not o["positions"]:
            return ["no position was compared"]
        out = []
        if exceeds(o["kl_mean"], th.max_mean_kl):
            out.append(f"KL mean {_fmt(o['kl_mean'], '.5f')} > {th.max_mean_kl}")
        if exceeds(o["kl_p99"], th.max_p99_kl):
            out.append(f"KL p99 {_fmt(o['kl_p99'], '.5f')} > {th.max_p99_kl}")
        if falls_short(o["same_top1"], th.min_same_top1):
            out.append(f"same top-1 {_fmt(o['same_top1'], '.3f')} < {th.min_same_top1}")
        return out

    @property
    def failures(self) -> list[str]:
        out = [self.model_mismatch] if self.model_mismatch else []
        if self.violations:
            out.append(f"{len(self.violations)} answer(s) not of the shape asked: {_some(self.violations, SHOWN)}")
        out += self.statistic_failures if not self.model_mismatch else []
        for p in self.paths:
            if p.outcome == "failed":
                out.append(f"{p.name}: {_some(p.failures, 3)}")
        return out

    @property
    def outcome(self) -> str:
        if self.failures:
            return "failed"
        return "could not run" if any(p.outcome == "could not run" for p in self.paths) else "passed"

    def verdict_line(self) -> str:
        o, th = self.overall.to_json(), self.thresholds
        checked = [p.label() for p in self.paths if p.outcome in ("passed", "failed")]
        head = {"passed": "verify passed: ", "failed": "verify FAILED: ", "could not run": "verify could not run: "}[
            self.outcome]
        if self.outcome == "failed":
            head += "; ".join(self.failures)
        else:
            head += (f"KL mean {_fmt(o['kl_mean'], '.5f')} <= {th.max_mean_kl}, p99 {_fmt(o['kl_p99'], '.5f')} <= "
                     f"{th.max_p99_kl}, same top-1 {_fmt(o['same_top1'], '.3f')} >= {th.min_same_top1}")
            if self.outcome == "could not run":
                head += "; " + "; ".join(f"{p.name} could not run: {p.reasons()}" for p in self.paths
                                         if p.outcome == "could not run")
        paths = f"; paths checked: {', '.join(checked)}" if checked else "; no other path checked"
        return (f"{head} ({o['positions']} positions against the reference's {self.side} side; "
                f"{KL_NOTE.format(k=self.k)}{paths}; {self.protocol} from {self.url}, model {self.model})")

    def to_json(self) -> dict:
        return {"kind": KIND, "schema_version": SCHEMA_VERSION, "outcome": self.outcome, "failures": self.failures,
                "violations": self.violations, "model_mismatch": self.model_mismatch, "url": self.url,
                "model": self.model, "against": self.side, "k": self.k, "protocol": self.protocol,
                "vocab_size": self.vocab_size,
                "kl_estimate": KL_NOTE.format(k=self.k), "thresholds": self.thresholds.model_dump(),
                "artifact": self.artifact, "overall": self.overall.to_json(),
                "texts": [t.to_json() for t in self.texts],
                "paths": {p.name: p.to_json() for p in self.paths}}


def render(report: VerifyReport) -> str:
    """The per-text table, one line per path checked, and the verdict line."""
    other = next(s for s in SIDES if s != report.side)
    lines = []
    if report.texts:
        lines.append(f"{'text':<16} {'positions':>9} {'KL mean':>9} {'KL p99':>9} {'KL max':>9} {'same top-1':>10} "
                     f"{'|d logprob|':>11} {'KL vs ' + other:>14}")
        for f in [*report.texts, report.overall]:
            j = f.to_json()
            lines.append(f"{j['name'][:16]:<16} {j['positions']:>9} {_fmt(j['kl_mean'], '9.5f')} "
                         f"{_fmt(j['kl_p99'], '9.5f')} {_fmt(j['kl_max'], '9.5f')} {_fmt(j['same_top1'], '10.3f')} "
                         f"{_fmt(j['target_logprob_mean_abs_diff'], '11.4f')} {_fmt(j['kl_other_side_mean'], '14.5f')}")
    lines += [p.line() for p in report.paths]
    return "\n".join(lines + [report.verdict_line()])


def could_not_run_json(message: str, exit_code: int, url: str | None = None) -> dict:
    """What ``verify --json`` prints when no report could be made (exit 2 or 3)."""
    outcome = {2: "bad input", 3: "could not run"}.get(exit_code, "failed")
    return {"kind": KIND, "schema_version": SCHEMA_VERSION, "outcome": outcome, "exit_code": exit_code,
            "error": message, "url": url}


# ------------------------------------------------------------------------------------ the whole check


def load_reference(artifact: Path):
    """The artifact's current reference, or ``CannotVerify`` saying why there is none."""
    from ..reference import read_reference

    try:
        return read_reference(Path(artifact), bound=True)  # the bound artifact's reference (core.bound)
    except HybridBuildError as e:
        raise CannotVerify(f"could not verify: no current reference: {one_line(e, 400)}") from None


def _recipe(artifact: Path):
    from hybrid_build.core.artifact import read_recipe_data
    from hybrid_build.recipes.schema import parse_recipe

    data = read_recipe_data(Path(artifact), missing_ok=True)
    return parse_recipe(data, str(artifact)) if data is not None else None


def expected_models(artifact: Path, side: str) -> list[str]:
    """The names the artifact's recipe serves the ``side`` under (every profile's, if none serves it)."""
    recipe = _recipe(artifact)
    if recipe is None:
        return []
    profiles = recipe.serve.profiles.values()
    names = [p.served_model_name for p in profiles if p.artifact == side] or [p.served_model_name for p in profiles]
    return sorted(set(names))


def claimed_prefix_caching(artifact: Path, side: str, profile: str | None = None) -> bool | None:
    """Whether the artifact's serve profile turns prefix caching on: ``profile``'s, else the one
    answer every profile serving ``side`` gives; None when they disagree or there is no recipe."""
    recipe = _recipe(artifact)
    if recipe is None:
        return None
    profiles = recipe.serve.profiles
    if profile is not None:
        if profile not in profiles:
            raise UserError(f"--profile {profile}: the artifact's recipe has no such profile "
                            f"({', '.join(profiles)})")
        return profiles[profile].enable_prefix_caching
    claims = {p.enable_prefix_caching for p in profiles.values() if p.artifact == side}
    return claims.pop() if len(claims) == 1 else None


def thresholds_of(artifact: Path) -> VerifySpec:
    recipe = _recipe(artifact)
    return recipe.verify if recipe is not None else VerifySpec()


def base_url_of(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> the ``/v1`` base URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def check_model(base_url: str, model: str | None, artifact: Path, side: str, api_key: str | None,
                timeout: float) -> tuple[str | None, dict, str | None]:
    """(the served model's name, what ``/v1/models`` says of it, a mismatch). ``model`` must be listed
    (else nothing can be checked: ``CannotVerify``); without it the server must list a name the
    artifact's recipe serves it under, and one that does not serves another model: a mismatch,
    which fails the check."""
    listed = served_models(base_url, api_key, timeout)
    names = ", ".join(sorted(listed)) or "no model"
    if model:
        if model in listed:
            return model, listed[model], None
        raise CannotVerify(f"could not verify: {base_url} serves {names}, not {model} (another model is served; "
                           "--model names it)")
    wanted = expected_models(artifact, side)
    found = [m for m in wanted if m in listed]
    if found:
        return found[0], listed[found[0]], None
    if not wanted:
        if len(listed) == 1:
            name = next(iter(listed))
            return name, listed[name], None
        raise CannotVerify(f"could not verify: {base_url} serves {names} and the artifact names none (--model "
                           "names it)")
    return None, {}, (f"{base_url} serves {names}, not the artifact's {' or '.join(wanted)} (a server of another "
                      "model; --model checks a name of your own)")


def verify_server(url: str, artifact: Path, *, side: str = "hybrid", model: str | None = None,
                  api_key: str | None = None, timeout: float = 120.0, thresholds: VerifySpec | None = None,
                  reference=None, paths: Callable | None = None) -> VerifyReport:
    """Compare the server at ``url`` with ``artifact``'s reference, then, with ``paths`` (``(Served,
    reference, thresholds) -> results``: ``verify_paths.checker``, which the command and ``serve``
    give), the paths where runtimes break. Every answer is checked for shape before any statistic.
    ``CannotVerify`` when nothing can be checked, ``KeyRefused`` when the server refuses the key.
    ``api_key``: sent as a Bearer token; None takes ``$OPENAI_API_KEY``, "" sends none."""
    from hybrid_build.core.artifact import artifact_identity

    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}")
    ref = reference or load_reference(artifact)
    base = base_url_of(url)
    api_key = client_key(api_key) if api_key is None else api_key  # "" sends none, whatever the environment holds
    vocab = vocab_size_of(artifact)
    report = VerifyReport(base, model or "", side, ref.k, "none", thresholds or thresholds_of(artifact), [],
                          artifact_identity(Path(artifact)), vocab_size=vocab)
    name, card, report.model_mismatch = check_model(base, model, artifact, side, api_key, timeout)
    if name is None:
        return report
    report.model = name
    answers, protocol = [], None
    for text in ref.texts.values():
        order = (protocol,) if protocol else tuple(PROTOCOLS)  # the first answer fixes the protocol
        rows, protocol = prompt_answer(base, name, text.token_ids, ref.k, api_key, timeout, order)
        answers.append((text, check_prompt(f"text {text.name!r}", rows, text.token_ids, ref.k, vocab,
                                           report.violations)))
    report.protocol = protocol or "none"
    if report.violations:  # no statistic on answers that are not log-probabilities
        return report
    report.texts = [compare_text(text, side, answer) for text, answer in answers]
    if paths is not None:
        served = Served(base, name, api_key, timeout, ref.k, vocab, card.get("max_model_len"))
        report.paths = paths(served, ref, report.thresholds)
    return report
