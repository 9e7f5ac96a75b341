"""bench's acceptance figures (vLLM's /metrics counters), its A/B verdicts and its low-acceptance flag.

Timing-dependent figures are checked on a fake clock (``standin_server.FakeNetwork``: the stand-in
in process, whose chat streams move the clock by exactly what the test says), so verdicts are exact;
the stand-in HTTP server is used where the assertions are about counters, flags, files and exit
codes, which do not depend on speed. The ``vllm``-marked tests read the metric names from the real
vLLM sources of every supported version and render the stand-in's counts through vLLM's own
``SpecDecodingProm`` and ``SpecDecodingLogging``, so that names, format and formulas cannot drift.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid_build.core.errors import ProtocolViolation
from hybrid_build.core.http_client import metrics_url, parse_metrics
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.bench import bench as bench_mod

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402
from standin_server import Engine, FakeNetwork, FakeServer, use_network  # noqa: E402

VERDICT = re.compile(r"^(B (faster|slower) by \d+\.\d%|within noise)$")


def fake_network(monkeypatch, **servers) -> FakeNetwork:
    clock = [1000.0]
    net = FakeNetwork({host: FakeServer(clock, **kw) for host, kw in servers.items()})
    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    use_network(monkeypatch, net.urlopen)
    return net


# ---- reading vLLM's counters -----------------------------------------------------------------------

def test_spec_counts_read_the_standins_vllm_exposition():
    engine = Engine(spec_tokens=4, accepted=(3, 1, 0))
    assert bench_mod.spec_counts(engine.render()) == bench_mod.SpecCounts(0, 0, 0, (0, 0, 0, 0))
    list(engine.run(11))  # prefill token, then steps of 4, 2, 1, 4 (accepted 3, 1, 0, 3)
    c = bench_mod.spec_counts(engine.render())
    assert c == bench_mod.SpecCounts(4, 16, 7, (3, 2, 2, 0))
    acc = bench_mod.acceptance_of(c)
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert acc["draft_acceptance_rate"] == pytest.approx(7 / 16)
    assert acc["per_position_rate"] == pytest.approx([0.75, 0.5, 0.5, 0])


def test_spec_counts_sum_engines_and_ignore_the_rest():
    text = textwrap.dedent('''\
        # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
        # TYPE vllm:spec_decode_num_drafts_total counter
        vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen"} 10.0
        vllm:spec_decode_num_drafts_total{engine="1",model_name="qwen"} 5.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="qwen"} 1.7961065354450772e+09
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen"} 40.0
        vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="qwen"} 20.0
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a \\"quoted\\", name"} 25.0
        vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="qwen"} 2.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="1"} 7.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="0"} 2.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="0"} 9.0
        vllm:generation_tokens_total{engine="0",model_name="qwen"} 999.0
        ''')
    assert bench_mod.spec_counts(text) == bench_mod.SpecCounts(15, 60, 27, (11, 7))
    assert parse_metrics("/metrics", text.encode()).samples("vllm:spec_decode_num_accepted_tokens")[0][0] == {
        "engine": "0", "model_name": 'a "quoted", name'}
    # an exposition without the _total suffix (bare counter names) reads the same
    assert bench_mod.spec_counts(text.replace("_total{", "{")) == bench_mod.SpecCounts(15, 60, 27, (11, 7))


@pytest.mark.parametrize("text", ["", Engine(spec_tokens=0).render()], ids=["empty", "vllm-without-speculation"])
def test_no_spec_counters_is_none(text):
    assert bench_mod.spec_counts(text) is None


@pytest.mark.parametrize("text", ["<html>not found</html>", '{"data": []}', "this is { not prometheus"])
def test_a_metrics_text_that_is_not_prometheus_is_one_line(text):
    with pytest.raises(ProtocolViolation, match="not Prometheus text"):
        bench_mod.spec_counts(text)


@pytest.mark.parametrize("base, metrics", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/metrics"),
    ("https://gpu.example/proxy/v1", "https://gpu.example/proxy/metrics"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
])
def test_metrics_url_is_at_the_server_root(base, metrics):
    assert metrics_url(base) == metrics


# ---- acceptance against the stand-in server ---------------------------------------------------------

def test_acceptance_from_a_speculating_standin(standin):
    # 4 drafted, 3 accepted per step: each 30-token run is the prefill token and 8 verified drafts,
    # whatever the speed; the warm-up run's counters are not counted
    url = standin("--tokens", "30", "--spec-tokens", "4", "--accepted", "3")
    report = bench_mod.bench(url, runs=2, max_tokens=30, workloads=["prose", "counting"])
    assert report["speculative"] and report["warnings"] == []
    for r in report["results"]:
        acc = r["acceptance"]
        assert (acc["drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (16, 64, 48)
        assert acc["accepted_per_pos"] == [16, 16, 16, 0]
        assert acc["mean_acceptance_length"] == 4.0 and acc["draft_acceptance_rate"] == 0.75
        assert acc["mean_acceptance_length_spread"] == [4.0, 4.0]
    assert "4.00 (75% of drafts)" in bench_mod.table(report)


def test_a_server_without_metrics_has_no_acceptance(standin):
    url = standin("--tokens", "6", "--spec-tokens", "4", "--no-metrics")
    report = bench_mod.bench(url, runs=1, max_tokens=6, workloads=["code"])
    assert report["results"][0]["acceptance"] is None and not report["speculative"]
    assert "no speculative-decoding counters" in bench_mod.table(report)


def test_a_useless_drafter_alone_is_warned_about(standin, capsys):
    url = standin("--tokens", "30", "--spec-tokens", "4", "--accepted", "0")
    assert main(["bench", url, "--runs", "1", "--max-tokens", "30", "--workloads", "agent"]) == 0
    out = capsys.readouterr().out
    assert "warning: agent: the drafter lands 0.00 tokens per draft" in out and "--compare" in out


# ---- the low-acceptance flag ------------------------------------------------------------------------

def _acc(accepted_per_draft: float, drafts: float = 100) -> dict:
    return bench_mod.acceptance_of(bench_mod.SpecCounts(drafts, 4 * drafts, accepted_per_draft * drafts))


@pytest.mark.parametrize("ref, other, flagged", [
    (3.0, 1.49, True),    # below half of the source's accepted tokens per draft
    (3.0, 1.5, False),    # exactly half: not below
    (3.0, 0.0, True),     # the dropped-MTP case: nothing lands
    (0.8, 0.02, True),    # a 1-token MTP: length 1.8 -> 1.02 (a length ratio of 0.57 would hide it)
    (0.4, 0.19, False),   # below half but only 0.21 fewer: two weak drafters do not flag each other
    (0.6, 0.3, False),    # exactly 0.3 fewer, but exactly half
    (0.6, 0.29, True),
])
def test_low_acceptance_rule(ref, other, flagged):
    assert bench_mod.low_acceptance(_acc(ref), _acc(other)) is flagged


def test_low_acceptance_needs_enough_drafts():
    assert bench_mod.low_acceptance(_acc(3.0, drafts=bench_mod.MIN_DRAFTS), _acc(0.0, drafts=bench_mod.MIN_DRAFTS))
    assert not bench_mod.low_acceptance(_acc(3.0), _acc(0.0, drafts=bench_mod.MIN_DRAFTS - 1))
    assert not bench_mod.low_acceptance(None, _acc(0.0)) and not bench_mod.low_acceptance(_acc(3.0), None)


def test_two_urls_flag_the_hybrid_that_lost_its_drafter(standin, capsys, tmp_path):
    """A: the source, 3 of 4 drafts accepted; B: a build whose drafter lands nothing. Exit 1, a FLAG
    per workload naming B, in the table and in the JSON."""
    source = standin("--tokens", "24", "--spec-tokens", "4", "--accepted", "3")
    broken = standin("--tokens", "24", "--spec-tokens", "4", "--accepted", "0")
    out = tmp_path / "ab.json"
    rc = main(["bench", source, broken, "--runs", "3", "--max-tokens", "24", "--workloads", "prose,agent",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    flags = [ln for ln in captured.out.splitlines() if ln.startswith("FLAG ")]
    assert [f.split(":")[0] for f in flags] == ["FLAG prose", "FLAG agent"]
    assert all("B lands 0.00 drafted tokens per step" in f and "A's 3.00" in f and "dropped" in f for f in flags)
    assert "low speculative acceptance in 2 workload(s)" in captured.err and captured.err.count("\n") == 1
    comparison = json.loads(out.read_text())
    assert comparison["kind"] == bench_mod.COMPARISON_KIND and comparison["interleaved"]
    assert [w["acceptance"]["flag"] is not None for w in comparison["workloads"]] == [True, True]
    assert comparison["workloads"][0]["acceptance"]["ratio"] == pytest.approx(1 / 4)
    for w in comparison["workloads"]:
        assert all(VERDICT.match(m["verdict"]) for m in w["metrics"])  # whatever the speed, one of these


def test_two_healthy_urls_are_not_flagged(standin, capsys):
    a = standin("--tokens", "16", "--spec-tokens", "4", "--accepted", "3")
    b = standin("--tokens", "16", "--spec-tokens", "4", "--accepted", "2")  # 2 of 4: 0.67 of A's, not below half
    assert main(["bench", a, b, "--runs", "3", "--max-tokens", "16", "--workloads", "counting", "--json"]) == 0
    comparison = json.loads(capsys.readouterr().out)
    assert comparison["flags"] == [] and comparison["workloads"][0]["acceptance"]["flag"] is None


# ---- verdicts on a fake clock -----------------------------------------------------------------------

def test_interleaved_a_b_and_exact_verdicts(monkeypatch):
    """A steps every 10 ms (+-0.2), B every 8 ms (+-0.1): the runs' ranges do not overlap, so
    decode and end-to-end get a verdict, exact from the medians; TTFT is the same on both."""
    net = fake_network(monkeypatch,
                       a=dict(engine=Engine(), tokens=21, first=0.05, steps=[0.010, 0.0102, 0.0098, 0.010]),
                       b=dict(engine=Engine(), tokens=21, first=0.05, steps=[0.008, 0.0081, 0.0079, 0.008]))
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=21,
                                      workloads=["prose", "code"])
    # per workload: a warm-up on each, then A, B, A, B, A, B
    assert net.order == ["a", "b"] + ["a", "b"] * 3 + ["a", "b"] + ["a", "b"] * 3
    rows = {m["metric"]: m for m in comparison["workloads"][0]["metrics"]}
    decode_a, decode_b = 20 / (20 * 0.010), 20 / (20 * 0.008)  # medians: the middle step time
    assert rows["decode_tok_s"]["a"]["median"] == pytest.approx(decode_a)
    assert rows["decode_tok_s"]["ratio"] == pytest.approx(decode_b / decode_a)
    verdict = rows["decode_tok_s"]["verdict"]
    assert verdict == f"B faster by {100 * (decode_b / decode_a - 1):.1f}%" == "B faster by 25.0%"
    e2e_a, e2e_b = 21 / (0.05 + 0.2), 21 / (0.05 + 0.16)
    assert rows["e2e_tok_s"]["verdict"] == f"B faster by {100 * (e2e_b / e2e_a - 1):.1f}%"
    assert rows["ttft_s"]["verdict"] == "within noise" and not rows["ttft_s"]["significant"]
    assert comparison["flags"] == [] and comparison["workloads"][0]["acceptance"]["a"] is None
    text = bench_mod.compare_table(comparison)
    assert "B faster by 25.0%" in text and "within noise" in text and "interleaved (A, B, A, B...)" in text


def test_answers_of_different_length_get_a_note(monkeypatch):
    """The H200 run: the hybrid stopped after 19 tokens where the source wrote 128, so its
    end-to-end tok/s carried the time to first token over fewer tokens. A length ratio above
    1.25 is said; equal lengths (the other workload) say nothing."""
    fake_network(monkeypatch, a=dict(engine=Engine(), tokens=128, first=0.05, steps=0.01),
                 b=dict(engine=Engine(), tokens=19, first=0.05, steps=0.01))
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=128, workloads=["code"])
    assert any(n.startswith("code: A wrote 128 tokens, B 19") for n in comparison["notes"])
    rows = {m["metric"]: m for m in comparison["workloads"][0]["metrics"]}
    assert rows["decode_tok_s"]["ratio"] == pytest.approx(1.0)  # the same engine speed
    fake_network(monkeypatch, a=dict(engine=Engine(), tokens=24, first=0.05, steps=0.01),
                 b=dict(engine=Engine(), tokens=20, first=0.05, steps=0.01))  # 1.2x: no note
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=128, workloads=["code"])
    assert not any("tokens, B" in n for n in comparison["notes"])


def test_overlapping_runs_are_within_noise(monkeypatch):
    # B's median is 2% faster, but one of its runs is slower than one of A's: no verdict
    fake_network(monkeypatch,
                 a=dict(engine=Engine(), tokens=11, first=0.05, steps=[0.01, 0.0100, 0.0101, 0.0099]),
                 b=dict(engine=Engine(), tokens=11, first=0.05, steps=[0.01, 0.0098, 0.0102, 0.0097]))
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=11, workloads=["code"])
    rows = {m["metric"]: m for m in comparison["workloads"][0]["metrics"]}
    assert rows["decode_tok_s"]["ratio"] == pytest.approx(0.0100 / 0.0098)
    assert rows["decode_tok_s"]["verdict"] == "within noise"


def test_ttft_verdict_is_in_speed(monkeypatch):
    # B's first token takes 125 ms against A's 100 ms: 20% less speed, said as "B slower by 20.0%"
    fake_network(monkeypatch, a=dict(engine=Engine(), tokens=5, first=[0.1, 0.1, 0.101, 0.099], steps=0.01),
                 b=dict(engine=Engine(), tokens=5, first=[0.125, 0.125, 0.126, 0.124], steps=0.01))
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=5, workloads=["prose"])
    ttft = next(m for m in comparison["workloads"][0]["metrics"] if m["metric"] == "ttft_s")
    assert ttft["ratio"] == pytest.approx(1.25) and ttft["verdict"] == "B slower by 20.0%"


def test_too_few_runs_give_no_verdict(monkeypatch):
    fake_network(monkeypatch, a=dict(engine=Engine(), tokens=5, steps=0.02),
                 b=dict(engine=Engine(), tokens=5, steps=0.01))
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=2, max_tokens=5, workloads=["prose"])
    decode = comparison["workloads"][0]["metrics"][0]
    assert decode["ratio"] == pytest.approx(2.0) and decode["verdict"] == "no verdict: fewer than 3 runs"


# ---- --compare of saved results ---------------------------------------------------------------------

def _saved(monkeypatch, tmp_path, name: str, steps: list, accepted: tuple, workloads=("prose", "counting")) -> Path:
    fake_network(monkeypatch, s=dict(engine=Engine(spec_tokens=4, accepted=accepted), tokens=21, first=0.05,
                                     steps=steps))
    path = tmp_path / name
    assert main(["bench", "http://s/v1", "--runs", "3", "--max-tokens", "21", "--workloads", ",".join(workloads),
                 "--out", str(path), "-q"]) == 0
    return path


def test_compare_saved_results(monkeypatch, tmp_path, capsys):
    a = _saved(monkeypatch, tmp_path, "source.json", [0.02, 0.020, 0.021, 0.019], (3,))
    b = _saved(monkeypatch, tmp_path, "hybrid.json", [0.02, 0.016, 0.0165, 0.0155], (3,), ("prose", "code"))
    capsys.readouterr()
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "(from source.json)" in out and "(from hybrid.json)" in out and "from saved results" in out
    # 20 tokens after the first in 5 steps of 4 (3 accepted + bonus): decode = 20 / (5 x step)
    prose = next(ln for ln in out.splitlines() if "decode tok/s" in ln)
    assert f"B faster by {100 * (0.020 / 0.016 - 1):.1f}%" in prose
    assert "4.00 (75% of drafts)" in out
    assert "note: only A ran counting: left out" in out and "note: only B ran code: left out" in out
    assert main(["bench", "--compare", str(a), str(b), "--json"]) == 0
    comparison = json.loads(capsys.readouterr().out)
    assert [w["workload"] for w in comparison["workloads"]] == ["prose"]
    assert comparison["a"]["file"] == "source.json" and not comparison["interleaved"]
    assert comparison["reports"]["a"]["results"][0]["samples"]


def test_compare_saved_results_flags_low_acceptance(monkeypatch, tmp_path, capsys):
    a = _saved(monkeypatch, tmp_path, "source.json", [0.02], (3,))
    b = _saved(monkeypatch, tmp_path, "hybrid.json", [0.02], (1, 0))
    assert main(["bench", "--compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "FLAG prose: B lands 0.50 drafted tokens per step (mean acceptance length 1.50)" in out
    assert "FLAG counting:" in out
    # the other way round, A is the one flagged
    assert main(["bench", "--compare", str(b), str(a)]) == 1
    assert "FLAG prose: A lands 0.50" in capsys.readouterr().out


def test_compare_refuses_what_it_cannot_compare(monkeypatch, tmp_path, capsys):
    good = _saved(monkeypatch, tmp_path, "good.json", [0.02], (3,))
    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps({"kind": bench_mod.COMPARISON_KIND}))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"prompt": "prose", "decode_tok_s": 30.0}]}))
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    capsys.readouterr()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # refused before it is opened: reading it would wait for a writer
    for path, words in ((pair, "holds a comparison"), (old, "older hybrid-build bench"), (junk, "not JSON"),
                        (tmp_path / "missing.json", "missing.json: no such file"),
                        (deep, "deep.json: JSON nested deeper than 100 levels"),
                        (fifo, "fifo.json: a FIFO, not a regular file")):
        assert main(["bench", "--compare", str(good), str(path)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1
    assert main(["bench", "http://s/v1", "--compare", str(good), str(good)]) == 2


# ---- against the real vLLM sources ------------------------------------------------------------------

def _source(version: str) -> Path:
    root = vllm_sources.unpacked(version)
    if root is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    return root


@pytest.mark.vllm
@pytest.mark.parametrize("version", vllm_sources.VERSIONS)
def test_metric_names_are_vllms(version):
    """The spec-decode counters bench reads are exactly those vLLM's SpecDecodingProm registers, as
    Counters, under the label names its Prometheus logger gives every engine."""
    root = _source(version)
    tree = ast.parse((root / "vllm/v1/spec_decode/metrics.py").read_text())
    prom = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SpecDecodingProm")
    names = {n.value for n in ast.walk(prom) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.startswith("vllm:spec_decode_")}
    assert names == set(bench_mod.SPEC_COUNTERS)
    counter_cls = next(n.value for n in prom.body if isinstance(n, ast.Assign)
                       and any(getattr(t, "id", None) == "_counter_cls" for t in n.targets))
    assert ast.unparse(counter_cls) == "prometheus_client.Counter"
    loggers = (root / "vllm/v1/metrics/loggers.py").read_text()
    assert 'labelnames = ["model_name", "engine"]' in loggers
    assert "idx: [model_name, str(idx)] for idx in engine_indexes" in loggers
    # the stand-in's exposition uses exactly these names and labels
    rendered = Engine(model="m", spec_tokens=2).render()
    assert {m.group(1) for m in re.finditer(r"^(vllm:spec_decode_\w+)_total\{", rendered, re.M)} == names
    assert 'engine="0",model_name="m"' in rendered


PROBE = r'''
import json, logging, sys, types
src, deps, steps, k = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
sys.path.append(deps)  # prometheus_client; the project's numpy stays first
for name, path in (("vllm", "vllm"), ("vllm.v1", "vllm/v1"), ("vllm.v1.metrics", "vllm/v1/metrics"),
                   ("vllm.v1.spec_decode", "vllm/v1/spec_decode")):
    mod = types.ModuleType(name); mod.__path__ = [f"{src}/{path}"]; sys.modules[name] = mod  # no heavy __init__
config = types.ModuleType("vllm.config"); config.SpeculativeConfig = object; sys.modules["vllm.config"] = config
logger = types.ModuleType("vllm.logger"); logger.init_logger = logging.getLogger; sys.modules["vllm.logger"] = logger
import prometheus_client
from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm, SpecDecodingStats
prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=k), ["model_name", "engine"], {0: ["qwen", "0"]})
logging_ = SpecDecodingLogging()
for step in steps:  # one scheduler step each, as the engine reports them
    stats = SpecDecodingStats.new(k)
    stats.observe_draft(num_draft_tokens=k, num_accepted_tokens=step)
    prom.observe(stats, 0)
    logging_.observe(stats)
lines = []
logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
print(json.dumps({"exposition": prometheus_client.generate_latest().decode(), "log": lines}))
'''


@pytest.mark.vllm
@pytest.mark.parametrize("version", vllm_sources.VERSIONS)
def test_standin_exposition_and_formulas_are_vllms(version, tmp_path):
    """The same drafts through vLLM's own SpecDecodingProm (with prometheus_client) give the
    stand-in's /metrics lines, timestamps aside; bench reads the same counts from both; and the
    mean acceptance length, acceptance rate and per-position rates bench computes are the ones
    vLLM's SpecDecodingLogging prints."""
    root = _source(version)
    deps = vllm_sources.deps_dir()
    if not (deps / ".complete").exists():
        pytest.skip("vLLM's CPU import dependencies not prepared (run .ci/vllm_sources.sh)")
    engine = Engine(model="qwen", spec_tokens=4, accepted=(3, 1, 4, 0, 2))
    for n in (17, 9, 30):
        list(engine.run(n))
    replay = Engine(model="qwen", spec_tokens=4, accepted=(3, 1, 4, 0, 2))
    steps = [a for n in (17, 9, 30) for _, a in replay.steps(n) if a is not None]
    r = subprocess.run([sys.executable, "-c", PROBE, str(root), str(deps), json.dumps(steps), "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    real = json.loads(r.stdout)

    def spec_lines(text: str) -> list[str]:
        lines = [ln for ln in text.splitlines() if "vllm:spec_decode_" in ln]
        return [re.sub(r"(_created\{.*\}) \S+$", r"\1 <time>", ln) for ln in lines]

    assert spec_lines(real["exposition"]) == spec_lines(engine.render())
    counts = bench_mod.spec_counts(real["exposition"])
    assert counts == bench_mod.spec_counts(engine.render())
    assert counts.drafts == len(steps) and counts.accepted_tokens == sum(steps)

    acc = bench_mod.acceptance_of(counts)
    (line,) = real["log"]
    assert float(re.search(r"Mean acceptance length: ([\d.]+)", line).group(1)) == pytest.approx(
        acc["mean_acceptance_length"], abs=0.005)
    assert float(re.search(r"Avg Draft acceptance rate: ([\d.]+)%", line).group(1)) == pytest.approx(
        100 * acc["draft_acceptance_rate"], abs=0.05)
    rates = [float(x) for x in re.search(r"Per-position acceptance rate: ([\d., ]+?),? Avg", line).group(1).split(",")]
    assert rates == pytest.approx(acc["per_position_rate"], abs=0.0005)


REQUEST_PROBE = r'''
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for body in json.loads(sys.argv[1]):
    r = ChatCompletionRequest.model_validate(body)
    out.append({"include_usage": r.stream_options.include_usage,
                "continuous_usage_stats": r.stream_options.continuous_usage_stats,
                "tools": len(r.tools or []), "max_tokens": r.max_tokens})
print(json.dumps(out))
'''


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "0.34.0"])  # 0.23.0's protocol module imports gguf
def test_vllm_takes_benchs_requests_with_the_running_count(version):
    """Every workload's request parses as vLLM's own ChatCompletionRequest, with the running token
    count in every chunk (continuous_usage_stats) that bench's decode timing reads switched on."""
    _source(version)
    path = vllm_sources.cpu_pythonpath(version)
    if path is None:
        pytest.skip("vLLM's CPU import dependencies not prepared (run .ci/vllm_sources.sh)")
    bodies = [bench_mod.request_body(w, "qwen", 64, False) for w in bench_mod.WORKLOADS.values()]
    env = dict(os.environ, **vllm_sources.cache_env(version), VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([path, str(Path(bench_mod.__file__).parents[2])]))
    r = vllm_sources.run_python(version, ["-c", REQUEST_PROBE, json.dumps(bodies)], env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = json.loads(r.stdout.strip().splitlines()[-1])  # vLLM logs to stdout before it
    assert [p["continuous_usage_stats"] for p in parsed] == [True] * len(bodies)
    assert all(p["include_usage"] and p["max_tokens"] == 64 for p in parsed)
    assert [p["tools"] for p in parsed] == [len(w.tools or []) for w in bench_mod.WORKLOADS.values()]
