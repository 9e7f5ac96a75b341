"""``hybrid-build verify``: the KL estimate and its bound on hand-made distributions, the shape check of
one answer, then the command against the stand-in server (tests/serve/standin_server.py) answering
from a real reference: a correct server with kernel noise passes, a corrupt one fails, every answer
that is not a log-probability of the shape asked fails naming the text and position, a trickling
server is dropped at the deadline, and each way it cannot run (dead URL, another model asked for,
no prompt log-probabilities, no reference) is one line and exit 3 (a JSON object with --json). Then
the paths (cache, concurrency, decode): a correct server passes each, a server broken on one path
fails that path alone, and a path that cannot be confirmed is "could not run" (exit 3)."""
from __future__ import annotations

import json
import math
import random
import socket
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from hybrid_build.validate.verify.verify import (
    LOGPROB_SLACK,
    check_position,
    exceeds,
    falls_short,
    kl_lumped,
    p99,
    request_body,
)

STANDIN = Path(__file__).resolve().parents[2] / "serve" / "standin_server.py"


# ------------------------------------------------------------------------------------ the estimate


def _softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def _estimate(p: list[float], q: list[float], k: int, actual: int) -> float:
    """The estimate from what vLLM would return: the reference's top-k of P, and Q's top-k plus the
    actual token."""
    ref = sorted(range(len(p)), key=lambda i: -p[i])[:k]
    top = sorted(range(len(q)), key=lambda i: -q[i])[:k]
    server = {i: math.log(q[i]) for i in [*top, actual]}
    return kl_lumped(ref, [math.log(p[i]) for i in ref], server, top)


def test_exact_when_the_server_returns_the_same_top_k_and_the_tail_is_one_token():
    rng = random.Random(0)
    k = 20
    for _ in range(50):
        lp = [rng.gauss(0, 2) for _ in range(k)] + [-30.0]  # token k is the tail: the least likely on both sides
        p = _softmax(lp)
        q = _softmax([x + rng.gauss(0, 0.3) if i < k else x for i, x in enumerate(lp)])
        assert set(sorted(range(k + 1), key=lambda i: -q[i])[:k]) == set(range(k))
        assert _estimate(p, q, k, actual=rng.randrange(k + 1)) == pytest.approx(_kl(p, q), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("kind", ["noise", "unrelated", "permuted", "flat"])
def test_the_estimate_never_exceeds_the_full_vocabulary_kl(kind):
    rng = random.Random(sum(map(ord, kind)))
    vocab, k = 300, 20
    for _ in range(60):
        scale = rng.choice([0.3, 1.0, 3.0, 6.0])
        lp = [rng.gauss(0, scale) for _ in range(vocab)]
        p = _softmax(lp)
        if kind == "noise":
            q = _softmax([x + rng.gauss(0, rng.choice([0.01, 0.1, 1.0])) for x in lp])
        elif kind == "unrelated":
            q = _softmax([rng.gauss(0, scale) for _ in range(vocab)])
        elif kind == "permuted":
            q = p[:]
            rng.shuffle(q)
        else:
            q = _softmax([rng.gauss(0, 0.01) for _ in range(vocab)])
        est, full = _estimate(p, q, k, actual=rng.randrange(vocab)), _kl(p, q)
        assert -1e-12 <= est <= full + 1e-9, (est, full)


def test_the_estimate_sees_a_server_that_answers_another_distribution():
    """Peaked reference, server peaked elsewhere: the reference's tokens it did not return are capped at
    its k-th probability, so the estimate is large, not lumped away into the tail."""
    rng = random.Random(1)
    vocab, k = 300, 20
    p = _softmax([rng.gauss(0, 4) for _ in range(vocab)])
    q = _softmax([rng.gauss(0, 4) for _ in range(vocab)])
    est = _estimate(p, q, k, actual=0)
    assert 0.3 * _kl(p, q) < est <= _kl(p, q)
    assert est > 1.0


def test_p99_is_numpys_linear_percentile():
    np = pytest.importorskip("numpy")
    values = [random.Random(2).expovariate(1.0) for _ in range(777)]
    assert p99(values) == pytest.approx(float(np.percentile(values, 99)))


def test_request_bodies():
    assert request_body("prompt_logprobs", "qwen", [1, 2, 3], 20) == {
        "model": "qwen", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 20}
    assert request_body("echo", "qwen", [1, 2], 20) == {
        "model": "qwen", "prompt": [1, 2], "echo": True, "max_tokens": 1, "temperature": 0, "logprobs": 20}


# ------------------------------------------------------------------------------------ one answer's shape


def _entries(k: int = 4, token: int = 7, outside: bool = True) -> list[tuple[int, float, int]]:
    """A valid answer: the top-k of a normalized distribution, plus the next token ranked after them."""
    lps = [math.log(p) for p in (0.4, 0.2, 0.1, 0.05, 0.03, 0.02)[:k]]
    out = [(i, lp, i + 1) for i, lp in enumerate(lps)]
    if outside:
        out.append((token, math.log(0.01), k + 1))
    return out


def _check(entries, k=4, vocab=100, token=7):
    violations: list[str] = []
    return check_position("text 't' position 5", entries, k, vocab, token, violations), violations


def test_a_valid_answer_gives_its_position():
    pos, violations = _check(_entries())
    assert not violations and pos.topk == [0, 1, 2, 3] and pos.actual == pytest.approx(math.log(0.01))
    pos, violations = _check(_entries(outside=False), token=2)  # the next token is among the top-k
    assert not violations and pos.topk == [0, 1, 2, 3] and pos.token == 2
    gen = [(i, lp, None) for i, lp, _ in _entries(outside=False)]  # no ranks (generated): the count says it
    assert _check(gen, token=0)[0] is not None


@pytest.mark.parametrize("change, says", [
    (lambda e: [(0, float("nan"), 1)] + e[1:], "log-probability is nan"),
    (lambda e: [(0, float("inf"), 1)] + e[1:], "log-probability is inf"),
    (lambda e: [(0, float("-inf"), 1)] + e[1:], "log-probability is -inf"),
    (lambda e: [(0, 0.5, 1)] + e[1:], "log-probability 0.5 is above 0"),
    (lambda e: [(0, None, 1)] + e[1:], "is not a number"),
    (lambda e: [(0, math.log(0.9), 1)] + e[1:], "sum to probability"),
    (lambda e: [(100, e[0][1], 1)] + e[1:], "token id 100 outside the vocabulary of 100"),
    (lambda e: e[:3] + e[4:], "3 top log-probabilities where 4 were asked for"),
    (lambda e: e[:-1], "no log-probability for the token that came next (7)"),
    (lambda e: e + [(9, math.log(0.001), 6)], "5 top log-probabilities where 4 were asked for"),
])
def test_an_answer_of_the_wrong_shape_is_named(change, says):
    pos, violations = _check(change(_entries()))
    assert pos is None and violations and all(v.startswith("text 't' position 5: ") for v in violations)
    assert any(says in v for v in violations), violations


def test_a_log_probability_may_exceed_zero_only_by_float32_rounding():
    """``logit - logsumexp`` in float32 can exceed 0 by one ulp of the logit: at most 7.6e-6 below 128."""
    import numpy as np

    assert float(np.spacing(np.float32(127.9))) < LOGPROB_SLACK
    top = [(0, LOGPROB_SLACK / 2, 1)] + [(i, -30.0, i + 1) for i in range(1, 4)] + [(7, -31.0, 5)]
    assert _check(top)[0] is not None
    assert _check([(0, 2 * LOGPROB_SLACK, 1)] + top[1:])[0] is None


def test_nan_exceeds_every_bound_and_falls_short_of_every_floor():
    for bad in (float("nan"), float("inf"), None):
        assert exceeds(bad, 1e9) and falls_short(bad, -1e9)
    assert not exceeds(0.1, 0.1) and exceeds(0.2, 0.1) and not falls_short(0.9, 0.9) and falls_short(0.8, 0.9)


# ------------------------------------------------------------------------------------ the command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def standins(referenced_artifact, tmp_path_factory):
    """``standins(*flags) -> base URL``: a stand-in server answering from the reference, one per set of
    flags, started once for the module."""
    from hybrid_build.serve.launch.engine import LaunchPlan
    from hybrid_build.serve.launch.launcher import start, wait_ready

    running: dict[tuple, tuple] = {}
    logs = tmp_path_factory.mktemp("standins")

    def get(*flags: str) -> str:
        if flags not in running:
            port = _free_port()
            plan = LaunchPlan([sys.executable, str(STANDIN), "--port", str(port), "--reference",
                               str(referenced_artifact), *flags], {}, "qwen", port, "127.0.0.1", "base", "local", "s")
            server = start(plan, logs / f"{port}.log")
            running[flags] = (server, plan.base_url)
            wait_ready(server, timeout=120, poll=0.2)
        return running[flags][1]

    yield get
    for server, _ in running.values():
        server.stop()


def _verify(capsys, url: str, artifact: Path, *extra: str) -> tuple[int, str, str]:
    from hybrid_build.pipeline.cli import main

    rc = main(["verify", url, "--artifact", str(artifact), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_a_correct_server_with_kernel_noise_passes(standins, referenced_artifact, capsys):
    rc, out, err = _verify(capsys, standins("--logprob-noise", "0.01"), referenced_artifact, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["outcome"] == "passed" and report["protocol"] == "prompt_logprobs" and report["k"] == 20
    overall, th = report["overall"], report["thresholds"]
    assert overall["positions"] == sum(len(t["token_ids"]) - 1 for t in json.loads(
        (referenced_artifact / "hybrid_build" / "reference.json").read_text())["texts"].values())
    # N(0, 0.01) on every log-probability: KL ~ var/2 = 5e-5 at most on the top-k, under the bounds
    assert 0 < overall["kl_mean"] < 5e-5 < th["max_mean_kl"] and overall["kl_p99"] < th["max_p99_kl"]
    assert overall["same_top1"] >= th["min_same_top1"]
    assert "lower bound" in report["kl_estimate"]


@pytest.mark.slow
def test_the_exact_reference_gives_zero_kl_and_the_text_table(standins, referenced_artifact, capsys):
    rc, out, _ = _verify(capsys, standins(), referenced_artifact)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["text", "positions", "KL", "mean"]
    assert lines[-1].startswith("verify passed: KL mean 0.00000 <= 0.0003") and "lower bound" in lines[-1]
    assert "same top-1 1.000" in lines[-1]
    overall = next(ln for ln in lines if ln.startswith("all ")).split()
    assert overall[2:6] == ["0.00000", "0.00000", "0.00000", "1.000"]
    assert overall[6] == "0.0000"  # the actual token's log-probability is the reference's own


@pytest.mark.slow
def test_a_server_that_only_answers_echo_is_verified_through_it(standins, referenced_artifact, capsys):
    rc, out, _ = _verify(capsys, standins("--legacy-echo"), referenced_artifact, "--json")
    assert rc == 0 and json.loads(out)["protocol"] == "echo"


@pytest.mark.slow
def test_a_corrupt_server_fails(standins, referenced_artifact, capsys):
    rc, out, _ = _verify(capsys, standins("--corrupt"), referenced_artifact)
    assert rc == 1
    verdict = out.splitlines()[-1]
    assert verdict.startswith("verify FAILED: ") and "same top-1" in verdict


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
def test_could_not_run_is_one_line_and_exit_3(standins, referenced_artifact, built_artifact, capsys):
    url = standins()
    rc, out, err = _verify(capsys, f"http://127.0.0.1:{_free_port()}/v1", referenced_artifact)
    assert rc == 3 and not out and "no server answers at" in _one_line(err)
    rc, out, err = _verify(capsys, url, referenced_artifact, "--model", "other")
    assert rc == 3 and "serves qwen, not other" in _one_line(err)
    rc, out, err = _verify(capsys, standins("--no-prompt-logprobs"), referenced_artifact)
    assert rc == 3 and "returned no prompt log-probabilities" in _one_line(err)
    assert "string-keyed" in err
    rc, out, err = _verify(capsys, url, built_artifact)  # built without the validate stage: no reference
    assert rc == 3 and "no current reference" in _one_line(err) and "hybrid-build validate" in err


def test_a_usage_mistake_is_exit_2(tmp_path, capsys):
    from hybrid_build.pipeline.cli import main

    assert main(["verify", "127.0.0.1:8000", "--artifact", str(tmp_path)]) == 2
    assert main(["verify", "http://127.0.0.1:8000", "--artifact", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["verify", "http://127.0.0.1:8000"])  # --artifact is required: a URL does not say which
    assert e.value.code == 2


# ------------------------------------------------------------------------------------ shape, model, deadline


def configure(url: str, **knobs) -> dict:
    """Set the stand-in's knobs (``--control``): ``POST /standin/config``."""
    root = url.rsplit("/v1", 1)[0]
    req = urllib.request.Request(root + "/standin/config", json.dumps(knobs).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


CORRECT = {"model": "qwen", "noise": 0.01, "fault": None, "cache_fault": None, "prefix_caching": True,
           "batch_fault": False, "decode_fault": False, "trickle": 0.0, "metrics": True}


@pytest.fixture
def controlled(standins):
    """``controlled(**knobs) -> URL``: the module's controllable stand-in (a correct server with kernel
    noise, but for ``knobs``), put back to correct after the test."""
    url = standins("--control")

    def set_knobs(**knobs) -> str:
        configure(url, **{**CORRECT, **knobs})
        return url

    yield set_knobs
    configure(url, **CORRECT)


@pytest.mark.slow
@pytest.mark.parametrize("fault, says", [
    ("nan", "position 1: token"), ("inf", "position 3: token"), ("positive", "position 3: token"),
    ("missing", "position 3: no log-probabilities"), ("truncated", "prompt positions answered"),
    ("short-topk", "position 3: 19 top log-probabilities where 20 were asked for"),
    ("out-of-vocab", "position 3: token id"),
])
def test_answers_that_are_not_log_probabilities_fail_naming_text_and_position(controlled, referenced_artifact,
                                                                               capsys, fault, says):
    rc, out, _ = _verify(capsys, controlled(fault=fault), referenced_artifact, "--json")
    report = json.loads(out)
    assert rc == 1 and report["outcome"] == "failed"
    first = json.loads((referenced_artifact / "hybrid_build" / "reference.json").read_text())["texts"]
    assert report["violations"][0].startswith(f"text {next(iter(first))!r}") and says in report["violations"][0]
    # no statistic from answers that are not log-probabilities, and no path run on them
    assert report["overall"]["positions"] == 0 and report["overall"]["kl_mean"] is None and report["paths"] == {}
    rc, out, _ = _verify(capsys, controlled(fault=fault), referenced_artifact)
    assert rc == 1 and out.splitlines()[-1].startswith("verify FAILED: ") and says in out.splitlines()[-1]


@pytest.mark.slow
def test_a_server_of_another_model_fails(controlled, referenced_artifact, capsys):
    rc, out, _ = _verify(capsys, controlled(model="llama"), referenced_artifact)
    assert rc == 1 and "serves llama, not the artifact's qwen" in out.splitlines()[-1]


@pytest.mark.slow
def test_a_trickling_server_is_dropped_at_the_deadline(controlled, referenced_artifact, capsys):
    """One byte every 50 ms: the answer (tens of kB) would take minutes; each read returns within
    any per-read timeout, so only a deadline for the whole request ends it. The command runs in a
    thread; the join's limit only keeps a broken build from hanging the suite."""
    url = controlled(trickle=0.05)
    result: dict = {}

    def run() -> None:
        result["rc"], result["out"], result["err"] = _verify(capsys, url, referenced_artifact, "--timeout", "0.5",
                                                             "--json")

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "verify was still reading a trickling answer past its deadline"
    assert result["rc"] == 3
    report = json.loads(result["out"])
    assert report["outcome"] == "could not run" and report["exit_code"] == 3
    assert "did not answer within 0.5 s" in _one_line(result["err"]) and "deadline" in report["error"]


@pytest.mark.parametrize("argv, says", [
    (["http://[::1"], "not a valid URL"),
    (["http://127.0.0.1:99999/v1"], "not a valid URL"),
    (["ftp://127.0.0.1:8000"], "not an http(s) URL"),
    (["http://127.0.0.1:8000", "--timeout", "-5"], "--timeout -5: must be more than 0 and at most 2,592,000"),
    (["http://127.0.0.1:8000", "--timeout", "abc"], "--timeout abc: not a number"),
    (["http://127.0.0.1:8000", "--timeout", "nan"], "--timeout nan: not a finite number"),
    (["http://127.0.0.1:8000", "--concurrency", "1"], "--concurrency 1: must be between 2 and 1,024"),
    (["http://127.0.0.1:8000", "--concurrency", "1000000000"], "--concurrency 1000000000: must be between 2 and 1,024"),
    (["http://127.0.0.1:8000", "--cache-tokens", "1e9"], "--cache-tokens 1e9: not a whole number"),
    (["http://127.0.0.1:8000", "--logprob-tol", "0"], "--logprob-tol 0: must be more than 0 and at most 10"),
    (["http://127.0.0.1:8000", "--logprob-tol", "1e308"], "--logprob-tol 1e308: must be more than 0 and at most 10"),
])
def test_bad_input_is_one_line_and_exit_2_and_json_says_so(tmp_path, capsys, argv, says):
    from hybrid_build.pipeline.cli import main

    assert main(["verify", *argv, "--artifact", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert not out and says in _one_line(err)
    assert main(["verify", *argv, "--artifact", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["outcome"] == "bad input" and report["exit_code"] == 2 and says in report["error"]


@pytest.mark.slow
def test_could_not_run_prints_json_too(referenced_artifact, capsys):
    from hybrid_build.pipeline.cli import main

    assert main(["verify", f"http://127.0.0.1:{_free_port()}/v1", "--artifact", str(referenced_artifact),
                 "--json"]) == 3
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["outcome"] == "could not run" and report["exit_code"] == 3
    assert "no server answers at" in report["error"] and "no server answers at" in _one_line(err)


def test_the_deadline_holds_while_the_headers_trickle():
    """A server that never finishes its header lines (one byte every 20 ms): each read waits at most
    the time left, so the request ends at its deadline though every read returns within any
    per-read timeout. The server thread stops on an event the test sets."""
    from hybrid_build.core.errors import CannotVerify
    from hybrid_build.core.http_client import HttpClient

    stop, listener = threading.Event(), socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.wait(0.02):
                try:
                    conn.sendall(b"a")
                except OSError:
                    return

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(CannotVerify, match="did not answer within 0.3 s"):
            HttpClient(timeout=0.3).get(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/models")
    finally:
        stop.set()
        server.join(timeout=30)
        listener.close()


# ------------------------------------------------------------------------------------ the paths


def _paths(capsys, url: str, artifact: Path, *extra: str) -> tuple[int, dict]:
    rc, out, _ = _verify(capsys, url, artifact, "--json", *extra)
    return rc, json.loads(out)


@pytest.mark.slow
def test_a_correct_server_passes_every_path_and_the_report_says_which(controlled, referenced_artifact, capsys):
    url = controlled()
    rc, report = _paths(capsys, url, referenced_artifact, "--prefix-caching", "on")
    assert rc == 0 and report["outcome"] == "passed", report["failures"]
    paths = report["paths"]
    assert list(paths) == ["cache", "concurrency", "decode"]
    assert all(p["outcome"] == "passed" and p["seconds"] > 0 and p["failures"] == [] for p in paths.values())
    cache = paths["cache"]
    # a 2048-token model: the prompt leaves room for the continuation; 16-token blocks, all but the
    # last token can hit
    assert cache["prompt_tokens"] == 2048 - 16 - 1 and cache["hit_tokens"] == (cache["prompt_tokens"] - 1) // 16 * 16
    assert cache["cold_hit_tokens"] == 0 and cache["checked"] == f"cache (hit {cache['hit_tokens']} tokens)"
    assert paths["concurrency"]["streams"] == 4 and paths["concurrency"]["positions"] >= 4
    assert paths["decode"]["positions"] == 32
    for p in paths.values():  # kernel noise N(0, 0.01): far inside the tiny recipe's bounds
        assert p["kl_mean"] < report["thresholds"]["max_mean_kl"] and p["logprob_max_abs_diff"] < 0.25
    rc, out, _ = _verify(capsys, url, referenced_artifact)
    lines = out.splitlines()
    assert rc == 0 and [ln.split()[1] for ln in lines if ln.startswith("path ")] == ["cache", "concurrency", "decode"]
    assert "paths checked: cache (hit 2016 tokens), concurrency (4 at once), decode;" in lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("knobs, failing, says", [
    ({"cache_fault": "state"}, "cache", "not a near-tie"),  # a hit restores the wrong state
    ({"cache_fault": "nan"}, "cache", "warm generated token 0: token"),  # NaN after a hit
    ({"cache_fault": "nohit"}, "cache", "prefix caching on and zero hits"),
    ({"prefix_caching": False}, "cache", "looked nothing up in its prefix cache"),
    ({"batch_fault": True}, "concurrency", "KL mean"),  # logits scaled in a batch: same argmax, other log-probs
    ({"decode_fault": True}, "decode", "where the prefill has"),
])
def test_a_server_broken_on_one_path_fails_that_path_alone(controlled, referenced_artifact, capsys, knobs, failing,
                                                             says):
    rc, report = _paths(capsys, controlled(**knobs), referenced_artifact, "--prefix-caching", "on")
    assert rc == 1 and report["outcome"] == "failed"
    outcomes = {name: p["outcome"] for name, p in report["paths"].items()}
    assert outcomes == {name: "failed" if name == failing else "passed" for name in outcomes}
    assert any(says in f for f in report["paths"][failing]["failures"]), report["paths"][failing]["failures"]
    assert report["overall"]["same_top1"] >= report["thresholds"]["min_same_top1"]  # the prompt path still passes


@pytest.mark.slow
def test_no_hit_fails_only_where_caching_is_claimed(controlled, referenced_artifact, capsys):
    """The tiny recipe's dense profile (the hybrid side) turns caching off: no claim, no failure,
    and the report says what ran; --profile base (caching on) claims it."""
    for knobs, note in (({"cache_fault": "nohit"}, "caching on, no hit at 2031 tokens"),
                        ({"prefix_caching": False}, "prefix caching off: compared two cold runs")):
        rc, report = _paths(capsys, controlled(**knobs), referenced_artifact)
        cache = report["paths"]["cache"]
        assert rc == 0 and cache["outcome"] == "passed" and cache["claimed"] is False and note in cache["notes"][0]
        assert cache["checked"] == "cache (no hit confirmed)"
        rc, report = _paths(capsys, controlled(**knobs), referenced_artifact, "--profile", "base")
        assert rc == 1 and report["paths"]["cache"]["outcome"] == "failed"
    rc, _, err = _verify(capsys, controlled(), referenced_artifact, "--profile", "nope")
    assert rc == 2 and "no such profile" in _one_line(err)


@pytest.mark.slow
def test_a_hit_that_cannot_be_confirmed_is_could_not_run_where_claimed(controlled, referenced_artifact, capsys):
    url = controlled(metrics=False)
    rc, report = _paths(capsys, url, referenced_artifact, "--prefix-caching", "on")
    assert rc == 3 and report["outcome"] == "could not run"
    cache = report["paths"]["cache"]
    assert cache["outcome"] == "could not run" and "no prefix-cache counters" in cache["could_not_run"]
    assert report["paths"]["concurrency"]["outcome"] == report["paths"]["decode"]["outcome"] == "passed"
    rc, out, _ = _verify(capsys, url, referenced_artifact, "--prefix-caching", "on")
    assert rc == 3 and out.splitlines()[-1].startswith("verify could not run: ")
    rc, report = _paths(capsys, url, referenced_artifact)  # no claim: compared, the hit unconfirmed
    assert rc == 0 and report["paths"]["cache"]["notes"] == ["hit not confirmed: no prefix-cache counters on /metrics"]


@pytest.mark.slow
def test_each_path_has_a_switch(controlled, referenced_artifact, capsys):
    url = controlled(decode_fault=True, cache_fault="state")
    rc, report = _paths(capsys, url, referenced_artifact, "--skip", "decode", "--skip", "cache", "--concurrency", "3")
    assert rc == 0, report["failures"]
    assert {n: p["outcome"] for n, p in report["paths"].items()} == {
        "cache": "skipped", "concurrency": "passed", "decode": "skipped"}
    assert report["paths"]["concurrency"]["streams"] == 3 and report["paths"]["decode"]["seconds"] is None
    rc, out, _ = _verify(capsys, url, referenced_artifact, "--skip", "decode", "--skip", "cache")
    assert "path decode       skipped (--skip decode)" in out and "paths checked: concurrency (4 at once);" in out
