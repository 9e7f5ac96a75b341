"""``bench`` against servers that answer what no protocol allows (``hostile_server.py``, a real child
process): each ends in one line and its documented exit code, with ``--json`` a JSON error object,
never a traceback; a redirect is not followed, and the key never reaches the other port (a second
server records every request it gets); a 200 MB answer is read up to the client's cap only."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KEY = "sk-hostile-test-key-1234"




def _bench(capsys, url: str, *extra: str) -> tuple[int, str, str]:
    from hybrid_build.pipeline.cli import main

    rc = main(["bench", url + "/v1", "--runs", "1", "--workloads", "code", "--max-tokens", "4", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


CASES = [  # (answer, on, exit code, what the line says)
    ("json-metrics", "/metrics", 3, "answered JSON, not Prometheus text"),
    ("html", "/v1/models", 3, "answered an HTML page, not JSON"),
    ("truncated", "/v1/models", 3, "the answer was cut off"),
    ("bad-utf8", "/v1/models", 3, "bytes that are not UTF-8"),
    ("nested", "/v1/models", 3, "JSON nested too deep to read"),
    ("huge", "/v1/models", 3, "answered more than 64 MiB: not read further"),
    ("json-metrics", "/v1/models", 3, "answered no model list"),
]


@pytest.mark.parametrize("answer, on, code, says", CASES, ids=[f"{a}-on-{o}" for a, o, _, _ in CASES])
def test_a_hostile_answer_is_one_line_and_its_exit_code(hostile, capsys, answer, on, code, says):
    if answer == "json-metrics" and on == "/v1/models":
        url = hostile("gateway", on="/v1/models")  # {} to every request: no model list
    else:
        url = hostile(answer, on=on)
    rc, out, err = _bench(capsys, url)
    assert rc == code and "Traceback" not in err, err[-2000:]
    assert says in err.strip().splitlines()[-1]
    rc, out, err = _bench(capsys, url, "--json")
    report = json.loads(out)
    assert rc == code and report["exit_code"] == code and says in report["error"] and "Traceback" not in err


@pytest.mark.parametrize("status, on", [("307", "/v1/models"), ("302", "/v1/chat/completions")])
def test_a_redirect_is_not_followed_and_the_key_stays_home(hostile, capsys, tmp_path, status, on):
    seen = tmp_path / "other-port.jsonl"
    other = hostile("models", record=seen)
    url = hostile(status, on=on, location=other)
    for extra in ((), ("--json",)):
        rc, out, err = _bench(capsys, url, "--api-key", KEY, *extra)
        assert rc == 2 and "Traceback" not in err
        line = json.loads(out)["error"] if extra else err.strip().splitlines()[-1]
        assert f"answered HTTP {status}, a redirect to {other}" in line and "not followed" in line
        assert KEY not in out + err
    # the other port got nothing, and it does record what it gets
    assert not seen.exists() or seen.read_text() == ""
    from hybrid_build.core.http_client import HttpClient

    HttpClient(api_key="probe-key-5678").get(other + "/v1/models")
    assert "Bearer probe-key-5678" in seen.read_text()


def test_a_200_mb_answer_is_read_up_to_the_cap_only(hostile, tmp_path):
    """The command's peak memory (its own ``ru_maxrss``) against a 200 MB answer exceeds that against a
    small answer by less than the cap and the read's buffers, far below the 200 MB read whole."""
    def peak(url: str) -> tuple[int, str, int]:
        env = dict(os.environ)
        proc = subprocess.Popen([sys.executable, "-m", "hybrid_build.pipeline.cli", "bench", url + "/v1", "--runs",
                                 "1", "--workloads", "code"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                env=env)
        err = proc.stderr.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, err, usage.ru_maxrss * 1024  # kilobytes on Linux

    small_rc, _, small = peak(hostile("html", on="/v1/models"))
    rc, err, huge = peak(hostile("huge", on="/v1/models"))
    assert small_rc == 3 and rc == 3 and "more than 64 MiB" in err and "Traceback" not in err
    assert huge - small < 64 * 2**20 + 48 * 2**20, (huge - small) / 2**20
