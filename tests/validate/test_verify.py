"""``hybrid-build verify``: the KL estimate and its bound on hand-made distributions, then the command
against the stand-in server (tests/serve/standin_server.py) answering from a real reference: a
correct server with kernel noise passes, a corrupt one fails, and each way it cannot run (dead URL,
another model, no prompt log-probabilities, no reference) is one line and exit 3."""
from __future__ import annotations

import json
import math
import random
import socket
import sys
from pathlib import Path

import pytest

from hybrid_build.validate.verify import kl_lumped, p99, request_body

STANDIN = Path(__file__).resolve().parents[1] / "serve" / "standin_server.py"


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


# ------------------------------------------------------------------------------------ the command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def standins(referenced_artifact, tmp_path_factory):
    """``standins(*flags) -> base URL``: a stand-in server answering from the reference, one per set of
    flags, started once for the module."""
    from hybrid_build.serve.engine import LaunchPlan
    from hybrid_build.serve.launcher import start, wait_ready

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
