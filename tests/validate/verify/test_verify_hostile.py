"""``verify`` against servers that answer what no protocol allows (``hostile_server.py``, a real child
process): each ends in one line and its documented exit code, with ``--json`` a JSON error object,
never a traceback (a ``RecursionError`` once, for 100,000 nested lists); a redirect is not followed
and the key never reaches the other port, whose server records every request it gets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

KEY = "sk-hostile-test-key-1234"




def _verify(capsys, url: str, artifact: Path, *extra: str) -> tuple[int, str, str]:
    from hybrid_build.pipeline.cli import main

    rc = main(["verify", url + "/v1", "--artifact", str(artifact), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


CASES = [  # (answer, on, exit code, what the line says)
    ("html", "/v1/models", 3, "answered an HTML page, not JSON"),
    ("truncated", "/v1/models", 3, "the answer was cut off"),
    ("bad-utf8", "/v1/models", 3, "bytes that are not UTF-8"),
    ("nested", "/v1/models", 3, "JSON nested too deep to read"),
    ("huge", "/v1/models", 3, "answered more than 64 MiB: not read further"),
    ("html", "/v1/completions", 3, "answered an HTML page, not JSON"),
]


@pytest.mark.slow
@pytest.mark.parametrize("answer, on, code, says", CASES, ids=[f"{a}-on-{o}" for a, o, _, _ in CASES])
def test_a_hostile_answer_is_one_line_and_its_exit_code(hostile, referenced_artifact, capsys, answer, on, code, says):
    url = hostile(answer, on=on)
    rc, out, err = _verify(capsys, url, referenced_artifact, "--model", "qwen")
    assert rc == code and "Traceback" not in err, err[-2000:]
    assert says in err.strip().splitlines()[-1]
    rc, out, err = _verify(capsys, url, referenced_artifact, "--model", "qwen", "--json")
    report = json.loads(out)
    assert rc == code and report["exit_code"] == code and says in report["error"] and "Traceback" not in err


@pytest.mark.slow
def test_a_json_metrics_makes_the_cache_path_say_so(hostile, referenced_artifact, capsys):
    """A gateway that answers JSON to ``GET /metrics``: the line says it is not Prometheus text. The
    prompt log-probabilities fail first here (the gateway answers ``{}``), so the line is checked
    through the client the paths read ``/metrics`` with."""
    from hybrid_build.core.errors import ProtocolViolation
    from hybrid_build.validate.verify.verify_paths import prefix_cache_counts

    url = hostile("json-metrics", on="/metrics")
    with pytest.raises(ProtocolViolation, match="answered JSON, not Prometheus text"):
        prefix_cache_counts(url + "/v1", None, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("status, on", [("302", "/v1/models"), ("307", "/v1/completions")])
def test_a_redirect_is_not_followed_and_the_key_stays_home(hostile, referenced_artifact, capsys, tmp_path, status,
                                                           on):
    seen = tmp_path / "other-port.jsonl"
    other = hostile("models", record=seen)
    url = hostile(status, on=on, location=other)
    for extra in ((), ("--json",)):
        rc, out, err = _verify(capsys, url, referenced_artifact, "--model", "qwen", "--api-key", KEY, *extra)
        assert rc == 2 and "Traceback" not in err
        line = json.loads(out)["error"] if extra else err.strip().splitlines()[-1]
        assert f"answered HTTP {status}, a redirect to {other}" in line and "not followed" in line
        assert KEY not in out + err
    assert not seen.exists() or seen.read_text() == ""
    from hybrid_build.core.http_client import HttpClient

    HttpClient(api_key="probe-key-5678").get(other + "/v1/models")
    assert "Bearer probe-key-5678" in seen.read_text()
