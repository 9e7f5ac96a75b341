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

Three outcomes: ``passed`` and ``failed`` (a ``VerifyReport``), or ``CannotVerify`` (exit 3, one
line): nothing answers, another model is served, no prompt log-probabilities, no reference. A
server that refuses the API key (none, or another: HTTP 401/403) is ``KeyRefused``, a usage
mistake (exit 2, one line).
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.api_key import bearer, client_key, raise_if_refused
from hybrid_build.core.errors import CannotVerify, HybridBuildError
from hybrid_build.recipes.schema import VerifySpec

KIND = "hybrid-build verify"
SCHEMA_VERSION = 1
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
    if p_tail == 0 and len(missing) * cap + outside <= budget:  # every missing token at its cap, the tail takes the rest
        q_missing, q_tail = [cap] * len(missing), budget - len(missing) * cap
    else:
        lam = _solve_lambda(missing, cap, p_tail, outside, max(budget, outside))
        q_missing, q_tail = [min(cap, pi / lam) for pi in missing], max(outside, p_tail / lam)
    kl += sum(pi * math.log(pi / max(q, _TINY)) for pi, q in zip(missing, q_missing) if pi > 0)
    return kl + (p_tail * math.log(p_tail / max(q_tail, _TINY)) if p_tail > 0 else 0.0)


# ------------------------------------------------------------------------------------ the server


@dataclass
class Position:
    """The server's answer at one prompt position: every returned id's log-probability, its top-k ids
    in rank order, and the log-probability of the token that actually came next."""

    logprobs: dict[int, float]
    topk: list[int]
    actual: float


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **bearer(api_key)}


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


def _request(url: str, payload: dict | None, api_key: str | None, timeout: float) -> dict:
    """A JSON request; a refused connection or a non-JSON answer is ``CannotVerify``, an HTTP error
    status is re-raised for the caller to word."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers=_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as e:
        raise CannotVerify(f"could not verify: no server answers at {url} ({_one_line(getattr(e, 'reason', e))})") from None
    try:
        return json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        raise CannotVerify(f"could not verify: {url} did not answer JSON (not an OpenAI-compatible server?)") from None


def _http_detail(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        body = ""
    return f"HTTP {e.code}" + (f": {_one_line(body)}" if body.strip() else "")


def served_models(base_url: str, api_key: str | None, timeout: float) -> list[str]:
    url = base_url + "/models"
    try:
        data = _request(url, None, api_key, timeout)
    except urllib.error.HTTPError as e:
        raise_if_refused(e, base_url, bool(api_key))
        raise CannotVerify(f"could not verify: {url} answered {_http_detail(e)}") from None
    try:
        return [str(m["id"]) for m in data["data"]]
    except (KeyError, TypeError):
        raise CannotVerify(f"could not verify: {url} answered no model list") from None


def _positions(choice: dict, token_ids: list[int], k: int) -> list[Position] | None:
    """The id-keyed ``prompt_logprobs`` of one choice (entry 0 is null), or None where there are none."""
    rows = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(rows, list) or len(rows) != len(token_ids):
        return None
    out = []
    for t, row in enumerate(rows[1:], start=1):
        if not isinstance(row, dict) or not row:
            return None
        try:
            entries = {int(i): (float(v["logprob"]), v.get("rank")) for i, v in row.items()}
        except (KeyError, TypeError, ValueError):
            return None
        ranked = sorted(entries, key=lambda i: -entries[i][0])
        topk = [i for i in ranked if isinstance(entries[i][1], int) and entries[i][1] <= k] or ranked[:k]
        actual = entries.get(token_ids[t])
        if actual is None:
            return None
        out.append(Position({i: lp for i, (lp, _) in entries.items()}, topk, actual[0]))
    return out


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


def prompt_logprobs(base_url: str, model: str, token_ids: list[int], k: int, api_key: str | None = None,
                    timeout: float = 120.0, protocols: tuple[str, ...] = tuple(PROTOCOLS)) -> tuple[list[Position], str]:
    """The server's prompt log-probabilities of ``token_ids`` and the protocol that gave them."""
    url, tried = base_url + "/completions", []
    for protocol in protocols:
        try:
            data = _request(url, request_body(protocol, model, token_ids, k), api_key, timeout)
        except urllib.error.HTTPError as e:
            raise_if_refused(e, base_url, bool(api_key))
            tried.append(f"{protocol}: {_http_detail(e)}")
            continue
        choices = data.get("choices") if isinstance(data, dict) else None
        found = _positions(choices[0], token_ids, k) if isinstance(choices, list) and choices else None
        if found is not None:
            return found, protocol
        legacy = bool(choices and isinstance(choices[0], dict) and (choices[0].get("logprobs") or {}).get("top_logprobs"))
        tried.append(f"{protocol}: " + ("only string-keyed top_logprobs (ids that decode alike collapse)" if legacy
                                        else "no id-keyed prompt_logprobs"))
    raise CannotVerify(f"could not verify: {url} returned no prompt log-probabilities ({'; '.join(tried)})")


# ------------------------------------------------------------------------------------ the figures


def p99(values: list[float]) -> float:
    """The 99th percentile, linear between order statistics (numpy's default)."""
    s = sorted(values)
    x = 0.99 * (len(s) - 1)
    lo = int(math.floor(x))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


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
        return {"name": self.name, "positions": n, "kl_mean": sum(self.kl) / n, "kl_p99": p99(self.kl),
                "kl_max": max(self.kl), "same_top1": sum(self.same_top1) / n,
                "target_logprob_mean_abs_diff": sum(self.target_diff) / n,
                "kl_other_side_mean": sum(self.kl_other) / n}


def compare_text(text, side: str, answer: list[Position]) -> Figures:
    """One text's figures against the reference's ``side`` (``reference.TextReference``)."""
    other = next(s for s in SIDES if s != side)
    fig = Figures(text.name)
    ids, lps, targets = text.top_ids[side].tolist(), text.top_logprobs[side].tolist(), text.target_logprob[side].tolist()
    o_ids, o_lps = text.top_ids[other].tolist(), text.top_logprobs[other].tolist()
    for row, pos in enumerate(answer):
        fig.kl.append(kl_lumped(ids[row], lps[row], pos.logprobs, pos.topk))
        fig.kl_other.append(kl_lumped(o_ids[row], o_lps[row], pos.logprobs, pos.topk))
        fig.same_top1.append(bool(pos.topk) and pos.topk[0] == ids[row][0])
        fig.target_diff.append(abs(pos.actual - targets[row]))
    return fig


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

    @property
    def overall(self) -> Figures:
        whole = Figures("all")
        for t in self.texts:
            whole.extend(t)
        return whole

    @property
    def failures(self) -> list[str]:
        o, th = self.overall.to_json(), self.thresholds
        out = []
        if o["kl_mean"] > th.max_mean_kl:
            out.append(f"KL mean {o['kl_mean']:.5f} > {th.max_mean_kl}")
        if o["kl_p99"] > th.max_p99_kl:
            out.append(f"KL p99 {o['kl_p99']:.5f} > {th.max_p99_kl}")
        if o["same_top1"] < th.min_same_top1:
            out.append(f"same top-1 {o['same_top1']:.3f} < {th.min_same_top1}")
        return out

    @property
    def outcome(self) -> str:
        return "failed" if self.failures else "passed"

    def verdict_line(self) -> str:
        o, th = self.overall.to_json(), self.thresholds
        head = (f"verify {'passed' if self.outcome == 'passed' else 'FAILED'}: " +
                ("; ".join(self.failures) if self.failures else
                 f"KL mean {o['kl_mean']:.5f} <= {th.max_mean_kl}, p99 {o['kl_p99']:.5f} <= {th.max_p99_kl}, "
                 f"same top-1 {o['same_top1']:.3f} >= {th.min_same_top1}"))
        return (f"{head} ({o['positions']} positions against the reference's {self.side} side; "
                f"{KL_NOTE.format(k=self.k)}; {self.protocol} from {self.url}, model {self.model})")

    def to_json(self) -> dict:
        return {"kind": KIND, "schema_version": SCHEMA_VERSION, "outcome": self.outcome, "failures": self.failures,
                "url": self.url, "model": self.model, "against": self.side, "k": self.k, "protocol": self.protocol,
                "kl_estimate": KL_NOTE.format(k=self.k), "thresholds": self.thresholds.model_dump(),
                "artifact": self.artifact, "overall": self.overall.to_json(),
                "texts": [t.to_json() for t in self.texts]}


def render(report: VerifyReport) -> str:
    """The per-text table and the verdict line."""
    other = next(s for s in SIDES if s != report.side)
    lines = [f"{'text':<16} {'positions':>9} {'KL mean':>9} {'KL p99':>9} {'KL max':>9} {'same top-1':>10} "
             f"{'|d logprob|':>11} {'KL vs ' + other:>14}"]
    for f in [*report.texts, report.overall]:
        j = f.to_json()
        lines.append(f"{j['name'][:16]:<16} {j['positions']:>9} {j['kl_mean']:>9.5f} {j['kl_p99']:>9.5f} "
                     f"{j['kl_max']:>9.5f} {j['same_top1']:>10.3f} {j['target_logprob_mean_abs_diff']:>11.4f} "
                     f"{j['kl_other_side_mean']:>14.5f}")
    return "\n".join(lines + [report.verdict_line()])


# ------------------------------------------------------------------------------------ the whole check


def load_reference(artifact: Path):
    """The artifact's current reference, or ``CannotVerify`` saying why there is none."""
    from .reference import read_reference

    try:
        return read_reference(Path(artifact))
    except HybridBuildError as e:
        raise CannotVerify(f"could not verify: no current reference: {_one_line(e, 400)}") from None


def expected_models(artifact: Path, side: str) -> list[str]:
    """The names the artifact's recipe serves the ``side`` under (every profile's, if none serves it)."""
    from hybrid_build.core.artifact import read_recipe_data
    from hybrid_build.recipes.schema import parse_recipe

    data = read_recipe_data(Path(artifact), missing_ok=True)
    if data is None:
        return []
    profiles = parse_recipe(data, str(artifact)).serve.profiles.values()
    names = [p.served_model_name for p in profiles if p.artifact == side] or [p.served_model_name for p in profiles]
    return sorted(set(names))


def thresholds_of(artifact: Path) -> VerifySpec:
    from hybrid_build.core.artifact import read_recipe_data
    from hybrid_build.recipes.schema import parse_recipe

    data = read_recipe_data(Path(artifact), missing_ok=True)
    return parse_recipe(data, str(artifact)).verify if data is not None else VerifySpec()


def base_url_of(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> the ``/v1`` base URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def check_model(base_url: str, model: str | None, artifact: Path, side: str, api_key: str | None,
                timeout: float) -> str:
    """The served model's name: ``model`` or one the recipe names, which the server must list."""
    listed = served_models(base_url, api_key, timeout)
    wanted = [model] if model else expected_models(artifact, side)
    found = [m for m in wanted if m in listed]
    if found:
        return found[0]
    if not wanted and len(listed) == 1:
        return listed[0]
    raise CannotVerify(f"could not verify: {base_url} serves {', '.join(listed) or 'no model'}, not "
                       f"{' or '.join(wanted) or 'the artifact'} (another model is served; --model names it)")


def verify_server(url: str, artifact: Path, *, side: str = "hybrid", model: str | None = None,
                  api_key: str | None = None, timeout: float = 120.0, thresholds: VerifySpec | None = None,
                  reference=None) -> VerifyReport:
    """Compare the server at ``url`` with ``artifact``'s reference; ``CannotVerify`` when that cannot run,
    ``KeyRefused`` when the server refuses the key. ``api_key``: sent as a Bearer token; None takes
    ``$OPENAI_API_KEY``, "" sends none."""
    from hybrid_build.core.artifact import artifact_identity

    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}")
    ref = reference or load_reference(artifact)
    base = base_url_of(url)
    api_key = client_key(api_key) if api_key is None else api_key  # "" sends none, whatever the environment holds
    name = check_model(base, model, artifact, side, api_key, timeout)
    texts, protocol = [], None
    for text in ref.texts.values():
        order = (protocol,) if protocol else tuple(PROTOCOLS)  # the first answer fixes the protocol
        answer, protocol = prompt_logprobs(base, name, text.token_ids, ref.k, api_key, timeout, order)
        texts.append(compare_text(text, side, answer))
    return VerifyReport(base, name, side, ref.k, protocol or "none", thresholds or thresholds_of(artifact), texts,
                        artifact_identity(Path(artifact)))
