"""Launcher (READY wait, timeout, early exit, smoke test, errors) and bench, against a stand-in
OpenAI-compatible server started by the test on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.errors import ArtifactError, ExternalToolError
from hybrid_build.serve import bench as bench_mod
from hybrid_build.serve.engine import LaunchPlan
from hybrid_build.serve.launcher import check_prerequisites, smoke_test, start, wait_ready

STANDIN = Path(__file__).resolve().parent / "standin_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_for(port: int, *extra: str) -> LaunchPlan:
    argv = [sys.executable, str(STANDIN), "--port", str(port), *extra]
    return LaunchPlan(argv, {}, "qwen", port, "127.0.0.1", "base", "local", "stand-in")


@pytest.fixture
def running(tmp_path):
    servers = []

    def _start(*extra: str):
        plan = plan_for(free_port(), *extra)
        server = start(plan, tmp_path / "server.log")
        servers.append(server)
        return server

    yield _start
    for s in servers:
        s.stop()


def test_waits_for_ready_then_smoke_test_passes(running, tmp_path):
    # the test, not a clock, decides when the stand-in becomes ready: only after wait_ready has
    # polled it twice while it answered 503 (a wait_ready that took a 503 for READY returns
    # before the file exists and fails the assertion below)
    ready = tmp_path / "ready"
    server = running("--ready-file", str(ready))
    answers: list[int] = []

    def tick(_elapsed):
        try:
            urllib.request.urlopen(server.plan.base_url + "/models", timeout=5).close()
            answers.append(200)
        except urllib.error.HTTPError as e:
            answers.append(e.code)
        except (urllib.error.URLError, OSError):
            return  # not listening yet
        if answers.count(503) >= 2:
            ready.touch()

    wait_ready(server, timeout=60, poll=0.05, on_tick=tick)
    assert ready.exists() and answers.count(503) >= 2, "READY must wait until /v1/models answers 200"
    assert 200 not in answers
    assert "Paris" in smoke_test(server.plan.base_url, "qwen")


def test_smoke_test_fails_without_paris(running):
    server = running("--answer", "Lyon, probably.")
    wait_ready(server, timeout=20, poll=0.1)
    with pytest.raises(ArtifactError, match="capital of France.*Lyon"):
        smoke_test(server.plan.base_url, "qwen")


def test_smoke_test_wrong_model_name(running):
    server = running()
    wait_ready(server, timeout=20, poll=0.1)
    with pytest.raises(ArtifactError, match="HTTP 404"):
        smoke_test(server.plan.base_url, "not-this-model")


def test_timeout_stops_the_server_and_tails_the_log(running):
    server = running("--ready-after", "60")
    t0 = time.monotonic()
    with pytest.raises(ExternalToolError, match=r"not ready after 1 s(.|\n)*loading weights"):
        wait_ready(server, timeout=1.0, poll=0.1)
    assert time.monotonic() - t0 < 15
    assert server.process.poll() is not None, "the server must be stopped after a timeout"


def test_early_exit_reports_code_and_log(running):
    server = running("--ready-after", "60", "--exit-after", "0.5")
    with pytest.raises(ExternalToolError, match=r"exited with code 3(.|\n)*out of memory"):
        wait_ready(server, timeout=30, poll=0.1)


def test_missing_vllm_and_docker_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for tool, hint in (("vllm", "pip install vllm"), ("docker", "install Docker")):
        plan = LaunchPlan([tool, "serve"], {}, "qwen", 8000, "127.0.0.1", "base", "local", "m")
        with pytest.raises(ExternalToolError, match=hint) as e:
            check_prerequisites(plan)
        assert "\n" not in str(e.value)


def test_missing_gpu_is_reported(monkeypatch, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text("#!/bin/sh\n")
    (fake / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    monkeypatch.setattr("hybrid_build.serve.launcher.Path.exists", lambda self: False)
    with pytest.raises(ExternalToolError, match="no NVIDIA GPU"):
        check_prerequisites(LaunchPlan(["vllm"], {}, "qwen", 1, "127.0.0.1", "base", "local", "m"))


def test_serve_cli_without_vllm_exits_with_one_line(tiny_artifact, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    rc = main(["serve", str(tiny_artifact), "--profile", "dense", "--drafter", "some/drafter"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "'vllm' was not found" in err


# ---- bench
def test_bench_measures_decode_and_end_to_end(running):
    # 30 tokens 20 ms apart after a 300 ms first token. A loaded machine only delays what the
    # client sees, so only bounds that hold on any machine are asserted here: TTFT >= 0.3 s and
    # end-to-end <= 30 / 0.88 s; the arithmetic itself is checked exactly with a fake clock below
    server = running("--tokens", "30", "--token-delay", "0.02", "--first-delay", "0.3")
    wait_ready(server, timeout=20, poll=0.1)
    report = bench_mod.bench(server.plan.base_url, runs=2, max_tokens=30, prompts=["prose", "code"])
    assert report["model"] == "qwen"
    assert [r["prompt"] for r in report["results"]] == ["prose", "code"]
    for r in report["results"]:
        assert r["runs"] == 2 and r["tokens"] == 30
        assert r["ttft_s"] >= 0.3
        assert 0 < r["e2e_tok_s"] <= 30 / 0.88
        assert r["decode_tok_s"] > 0


class _FakeStream:
    """A streamed chat completion whose reading moves a fake clock: ``first`` s before the first
    chunk, ``gap`` s before each later one; ``usage`` adds the usage chunk."""

    def __init__(self, clock: list[float], tokens: int, first: float, gap: float, usage: bool):
        self.clock, self.tokens, self.first, self.gap, self.usage = clock, tokens, first, gap, usage

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        yield b": keep-alive\n"
        for i in range(self.tokens):
            self.clock[0] += self.first if i == 0 else self.gap
            event = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            yield f"data: {json.dumps(event)}\n".encode()
            yield b"\n"
        if self.usage:
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': self.tokens}})}\n".encode()
        yield b"data: [DONE]\n"


@pytest.mark.parametrize("usage", [True, False], ids=["usage-chunk", "counted-chunks"])
def test_bench_arithmetic_on_a_fake_clock(monkeypatch, usage):
    clock = [1000.0]
    requests = []

    def urlopen(req, timeout=None):
        requests.append(json.loads(req.data))
        return _FakeStream(clock, 30, 0.3, 0.02, usage)

    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench_mod.urllib.request, "urlopen", urlopen)
    report = bench_mod.bench("http://stand-in/v1", model="qwen", runs=2, max_tokens=30, prompts=["prose", "tool-call"])
    assert len(requests) == 6 and all(r["stream"] and r["temperature"] == 0 for r in requests)
    assert "tools" in requests[-1] and "tools" not in requests[0]
    for r in report["results"]:
        assert r["runs"] == 2 and r["tokens"] == 30
        assert r["ttft_s"] == pytest.approx(0.3)
        assert r["decode_tok_s"] == pytest.approx(29 / 0.58)  # excludes the first token's wait
        assert r["e2e_tok_s"] == pytest.approx(30 / 0.88)


def test_bench_discards_the_first_run(running, monkeypatch):
    server = running()
    wait_ready(server, timeout=20, poll=0.1)
    calls = []
    real = bench_mod.stream_once
    monkeypatch.setattr(bench_mod, "stream_once", lambda *a, **k: calls.append(1) or real(*a, **k))
    report = bench_mod.bench(server.plan.base_url, runs=3, max_tokens=5, prompts=["tool-call"])
    assert len(calls) == 4 and report["results"][0]["runs"] == 3


def test_bench_cli_json_and_table(running, capsys):
    server = running("--tokens", "8")
    wait_ready(server, timeout=20, poll=0.1)
    assert main(["bench", server.plan.base_url, "--runs", "1", "--max-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in report["results"]] == ["prose", "code", "tool-call"]
    assert main(["bench", server.plan.base_url, "--runs", "1", "--max-tokens", "8", "--prompts", "code"]) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "code" in out


def test_bench_cli_errors(capsys):
    assert main(["bench", "http://127.0.0.1:9/v1", "--prompts", "poetry"]) == 2
    assert main(["bench", f"http://127.0.0.1:{free_port()}/v1", "--runs", "1"]) == 1
    assert "cannot reach" in capsys.readouterr().err
