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

from hybrid_build.core.errors import ArtifactError, ExternalToolError
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.bench import bench as bench_mod
from hybrid_build.serve.launch.engine import LaunchPlan
from hybrid_build.serve.launch.launcher import check_prerequisites, smoke_test, start, wait_ready

STANDIN = Path(__file__).resolve().parents[1] / "standin_server.py"
sys.path.insert(0, str(STANDIN.parent))
from standin_server import Engine, FakeNetwork, FakeServer, use_network  # noqa: E402


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


def test_smoke_test_follows_the_recipes_expectation(running):
    server = running("--answer", "zq blorp")  # what a random-weight model says
    wait_ready(server, timeout=20, poll=0.1)
    assert smoke_test(server.plan.base_url, "qwen", expect=None) == "zq blorp"
    with pytest.raises(ArtifactError, match="smoke_expect is 'Paris'"):
        smoke_test(server.plan.base_url, "qwen")


def test_smoke_test_refuses_an_empty_answer_even_from_random_weights(running):
    server = running("--answer", "")
    wait_ready(server, timeout=20, poll=0.1)
    with pytest.raises(ArtifactError, match="empty answer"):
        smoke_test(server.plan.base_url, "qwen", expect=None)


def test_the_tiny_recipe_expects_no_paris_and_the_real_ones_do(tiny_artifact):
    from hybrid_build.recipes import load_recipe
    from hybrid_build.serve.launch.engine import plan_launch

    assert plan_launch(str(tiny_artifact), "dense").smoke_expect is None
    for name in ("qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "qwen3.5-moe", "qwen3.5-397b-a17b"):
        assert load_recipe(name).serve.smoke_expect == "Paris"


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
    monkeypatch.setattr("hybrid_build.serve.launch.launcher.Path.exists", lambda self: False)
    with pytest.raises(ExternalToolError, match="no NVIDIA GPU"):
        check_prerequisites(LaunchPlan(["vllm"], {}, "qwen", 1, "127.0.0.1", "base", "local", "m"))


def test_serve_cli_without_vllm_exits_with_one_line(tiny_artifact, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    rc = main(["serve", str(tiny_artifact), "--profile", "dense", "--drafter", "some/drafter"])
    err = capsys.readouterr().err
    assert rc == 3 and err.count("\n") == 1 and "'vllm' was not found" in err  # no engine: could not run


# ---- bench
def test_bench_measures_decode_and_end_to_end(running):
    # 30 tokens 20 ms apart after a 300 ms first token. A loaded machine only delays what the
    # client sees, so only bounds that hold on any machine are asserted here: TTFT >= 0.3 s and
    # end-to-end <= 30 / 0.88 s; the arithmetic itself is checked exactly with a fake clock below
    server = running("--tokens", "30", "--token-delay", "0.02", "--first-delay", "0.3")
    wait_ready(server, timeout=20, poll=0.1)
    report = bench_mod.bench(server.plan.base_url, runs=2, max_tokens=30, workloads=["prose", "code"])
    assert report["model"] == "qwen" and report["kind"] == bench_mod.REPORT_KIND
    assert [r["workload"] for r in report["results"]] == ["prose", "code"]
    for r in report["results"]:
        assert r["runs"] == 2 and r["tokens"] == 30 and len(r["samples"]) == 2
        assert r["ttft_s"] >= 0.3 and r["spread"]["ttft_s"][0] >= 0.3
        assert 0 < r["e2e_tok_s"] <= 30 / 0.88
        assert r["decode_tok_s"] > 0
        assert r["acceptance"] is None  # a stand-in without speculation has no spec counters, as vLLM
    assert not report["speculative"]


def _fake(monkeypatch, **servers) -> tuple[list[float], FakeNetwork]:
    clock = [1000.0]
    net = FakeNetwork({host: FakeServer(clock, **kw) for host, kw in servers.items()})
    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    use_network(monkeypatch, net.urlopen)
    return clock, net


@pytest.mark.parametrize("usage", [True, False], ids=["usage-chunk", "counted-chunks"])
def test_bench_arithmetic_on_a_fake_clock(monkeypatch, usage):
    _, net = _fake(monkeypatch, **{"stand-in": dict(engine=Engine(), tokens=30, first=0.3, steps=0.02, usage=usage)})
    report = bench_mod.bench("http://stand-in/v1", runs=2, max_tokens=30, workloads=["prose", "agent"])
    requests = net.servers["stand-in"].requests
    assert report["model"] == "qwen"
    assert len(requests) == 6 and all(r["stream"] and r["temperature"] == 0 for r in requests)
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in requests)
    assert "tools" in requests[-1] and "tools" not in requests[0]
    assert requests[-1]["messages"][-1]["role"] == "tool"  # the agent turn regenerates the next assistant turn
    for r in report["results"]:
        assert r["runs"] == 2 and r["tokens"] == 30
        assert r["ttft_s"] == pytest.approx(0.3)
        assert r["decode_tok_s"] == pytest.approx(29 / 0.58)  # excludes the first token's wait
        assert r["e2e_tok_s"] == pytest.approx(30 / 0.88)
        assert r["spread"]["decode_tok_s"] == pytest.approx([29 / 0.58, 29 / 0.58])


@pytest.mark.parametrize("blank, window_steps, ttft_steps", [((4, 30), 3, 0), ((0, 20), 9, 20)],
                         ids=["text-stops-early", "text-starts-late"])
def test_blank_chunks_do_not_shrink_the_decode_window(monkeypatch, blank, window_steps, ttft_steps):
    """Tokens that stream with empty content (text the detokenizer holds back, or a random
    model's byte tokens: on the H200 the hybrid's 19 tokens showed text only in the first 34 ms
    and read as 494 tok/s). With the running count vLLM puts in every chunk
    (continuous_usage_stats) the window runs from the first to the last generated token: the rate
    is exact either way. A server that ignores the option gets the content-chunk window."""
    _fake(monkeypatch, s=dict(engine=Engine(), tokens=30, first=0.3, steps=0.02, blank=blank))
    r = bench_mod.bench("http://s/v1", runs=2, max_tokens=30, workloads=["code"])["results"][0]
    assert r["decode_tok_s"] == pytest.approx(29 / 0.58)
    assert r["ttft_s"] == pytest.approx(0.3)
    assert [s["decode_tokens"] for s in r["samples"]] == [29, 29]

    class NoRunningCount(FakeServer):  # a server that ignores continuous_usage_stats
        def stream(self, body):
            return super().stream({**body, "stream_options": {"include_usage": True}})

    clock = [0.0]
    net = FakeNetwork({"t": NoRunningCount(clock, Engine(), tokens=30, first=0.3, steps=0.02, blank=blank)})
    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    use_network(monkeypatch, net.urlopen)
    r = bench_mod.bench("http://t/v1", runs=2, max_tokens=30, workloads=["code"])["results"][0]
    assert r["ttft_s"] == pytest.approx(0.3 + ttft_steps * 0.02)  # the first visible text
    assert r["decode_tok_s"] == pytest.approx(29 / (window_steps * 0.02))  # 29 tokens over the visible window


def test_bench_on_a_server_without_a_tool_parser_says_what_to_do(monkeypatch):
    """vLLM without a tool-call parser refuses the agent workload's tools with a 400 (found against a
    real vLLM 0.25.1): the one line names the workload and the --workloads that leaves it out,
    and that list runs on the same server."""
    _fake(monkeypatch, **{"stand-in": dict(engine=Engine(), tokens=8, tool_parser=False)})
    with pytest.raises(ExternalToolError) as e:
        bench_mod.bench("http://stand-in/v1", runs=1, max_tokens=8, workloads=["prose", "agent"])
    line = str(e.value)
    assert "HTTP 400" in line and "--enable-auto-tool-choice" in line and "\n" not in line
    rest = line.rsplit("--workloads ", 1)[1].rstrip(")").split(",")
    assert "agent" in line.split("--workloads")[0] and "agent" not in rest and rest
    report = bench_mod.bench("http://stand-in/v1", runs=1, max_tokens=8, workloads=rest)
    assert [r["workload"] for r in report["results"]] == rest


def test_bench_median_and_range_of_runs(monkeypatch):
    """Runs that differ: the figure is their median, the spread their range (the warm-up run, at
    the first step time, is left out)."""
    steps = [0.5, 0.02, 0.025, 0.01]  # the warm-up, then 3 measured runs
    _fake(monkeypatch, s=dict(engine=Engine(), tokens=11, first=0.1, steps=steps))
    r = bench_mod.bench("http://s/v1", runs=3, max_tokens=11, workloads=["code"])["results"][0]
    decode = sorted(10 / (10 * g) for g in steps[1:])
    assert r["decode_tok_s"] == pytest.approx(decode[1])
    assert r["spread"]["decode_tok_s"] == pytest.approx([decode[0], decode[2]])
    assert r["e2e_tok_s"] == pytest.approx(11 / 0.3)
    assert [s["decode_s"] for s in r["samples"]] == pytest.approx([0.2, 0.25, 0.1])


def test_bench_speculative_chunks_and_acceptance_on_a_fake_clock(monkeypatch):
    """A speculating server sends each step's accepted tokens and bonus token in one chunk: 30
    tokens with 4 drafted and 3 accepted per step are the prefill's token then 8 steps (7 of 4 and
    one cut to 1). Decode and end-to-end use the usage count; the counters give length 4.0."""
    _fake(monkeypatch, s=dict(engine=Engine(spec_tokens=4, accepted=(3,)), tokens=30, first=0.3, steps=0.02))
    r = bench_mod.bench("http://s/v1", runs=2, max_tokens=30, workloads=["counting"])["results"][0]
    assert r["decode_tok_s"] == pytest.approx(29 / (8 * 0.02))
    assert r["e2e_tok_s"] == pytest.approx(30 / (0.3 + 8 * 0.02))
    acc = r["acceptance"]
    assert (acc["drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (16, 64, 48)  # 2 runs, warm-up excluded
    assert acc["mean_acceptance_length"] == pytest.approx(4.0) and acc["draft_acceptance_rate"] == pytest.approx(0.75)
    assert acc["accepted_per_pos"] == [16, 16, 16, 0]
    assert [s["spec"]["drafts"] for s in r["samples"]] == [8, 8]


def test_bench_discards_the_first_run(running, monkeypatch):
    server = running()
    wait_ready(server, timeout=20, poll=0.1)
    calls = []
    real = bench_mod.stream_once
    monkeypatch.setattr(bench_mod, "stream_once", lambda *a, **k: calls.append(1) or real(*a, **k))
    report = bench_mod.bench(server.plan.base_url, runs=3, max_tokens=5, workloads=["agent"])
    assert len(calls) == 4 and report["results"][0]["runs"] == 3


def test_bench_cli_json_and_table(running, capsys, tmp_path):
    server = running("--tokens", "8")
    wait_ready(server, timeout=20, poll=0.1)
    out = tmp_path / "r.json"
    assert main(["bench", server.plan.base_url, "--runs", "1", "--max-tokens", "8", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["workload"] for r in report["results"]] == ["prose", "code", "counting", "agent"]
    assert json.loads(out.read_text()) == report
    assert main(["bench", server.plan.base_url, "--runs", "1", "--max-tokens", "8", "--workloads", "code"]) == 0
    text = capsys.readouterr().out
    assert "decode tok/s" in text and "code" in text and "no speculative-decoding counters" in text


def test_bench_cli_errors(capsys):
    assert main(["bench", "http://127.0.0.1:9/v1", "--workloads", "poetry"]) == 2
    assert "unknown workload 'poetry'" in capsys.readouterr().err
    assert main(["bench", "127.0.0.1:9/v1"]) == 2
    assert main(["bench"]) == 2
    assert main(["bench", "http://a/v1", "http://b/v1", "http://c/v1"]) == 2
    assert main(["bench", f"http://127.0.0.1:{free_port()}/v1", "--runs", "1"]) == 3  # no server: could not run
    err = capsys.readouterr().err
    assert "no server answers at" in err and err.count("\n") == 4
