"""bench --agent: time to first token for agents (a long prefix plus a new turn, cold and warm) and
the prefix-cache hit rate from /metrics.

Exact figures come from the stand-in in process on a fake clock (``standin_server.FakeServer`` with
a ``PrefixCache``: its first token comes ``prefill`` s per prompt token the cache does not hold), so
cold and warm TTFT and the hit rate are arithmetic the test redoes from the requests bench sent.
The stand-in HTTP server checks the same with real sockets and N streams at once, asserting only on
counts, which do not depend on speed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.serve.bench import bench as bench_mod
from hybrid_build.serve.bench.bench_agent import MAX_TOKENS, parse_contexts

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from standin_server import Engine, FakeNetwork, FakeServer, PrefixCache, chat_token_ids, use_network  # noqa: E402

FIRST, PREFILL, BLOCK = 0.05, 1e-4, 16


def agent_network(monkeypatch, cache: bool = True, max_model_len: int | None = None) -> FakeNetwork:
    clock = [1000.0]
    pc = PrefixCache(BLOCK) if cache else None
    server = FakeServer(clock, Engine(cache=pc), first=FIRST, steps=0.01, cache=pc, prefill=PREFILL,
                        max_model_len=max_model_len)
    net = FakeNetwork({"a:1": server})
    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
    use_network(monkeypatch, net.urlopen)
    return net


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["bench", *argv])
    except SystemExit as e:  # argparse's mistakes leave main as exit 2, the line on stderr
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_sessions_whose_words_hashed_alike_share_no_block():
    """Two session words that crc32 modulo 4096 (the stand-in's former tokenizer) gave one token id:
    the second session's cold prompt then counted its whole prefix as a hit. Every word has its own
    id now, so the prompts part in their first block, while a resent prompt still hits."""
    import zlib

    from hybrid_build.serve.bench.bench_agent import TURNS, messages

    a, b = "0000000003cd", "000000000400"
    assert zlib.crc32(f"{a}.".encode()) % 4096 == zlib.crc32(f"{b}.".encode()) % 4096
    first, second = (chat_token_ids({"messages": messages(s, 40, TURNS[0])}) for s in (a, b))
    assert first[:12] == second[:12] and first[12] != second[12]  # role + the head's words, then the session
    cache = PrefixCache(BLOCK)
    cache.store(first, None)
    assert cache.lookup(second, None) == 0
    assert cache.lookup(first, None) == (len(first) - 1) // BLOCK * BLOCK


def test_cold_and_warm_ttft_and_the_hit_rate_are_the_servers(monkeypatch, capsys):
    net = agent_network(monkeypatch)
    rc, out, _ = _run(capsys, "http://a:1/v1", "--agent", "--contexts", "512,2k", "--runs", "2", "--json", "-q")
    assert rc == 0
    report = json.loads(out)
    assert report["kind"] == "hybrid-build bench agent" and [r["context"] for r in report["results"]] == [512, 2048]
    bodies = net.servers["a:1"].requests
    assert all(b["max_tokens"] == MAX_TOKENS and b["stream"] for b in bodies)
    measured = bodies[2:]  # the first two calibrate the prefix size
    assert len(measured) == 2 * (2 + 1) + 2 * 2  # per context: runs x (cold, warm), one warm-up run at the first
    for r, turns in zip(report["results"], (measured[2:6], measured[6:])):
        colds, warms = turns[0::2], turns[1::2]
        for run, (cold, warm) in enumerate(zip(colds, warms)):
            c, w = chat_token_ids(cold), chat_token_ids(warm)
            assert cold["messages"][0] == warm["messages"][0] and cold["messages"][1] != warm["messages"][1]
            hit = min(_common(c, w), len(w) - 1) // BLOCK * BLOCK  # the session's prefix, whole blocks
            sample_c, sample_w = r["samples"]["cold"][run][0], r["samples"]["warm"][run][0]
            assert sample_c["ttft_s"] == pytest.approx(FIRST + PREFILL * len(c))  # nothing of a new session cached
            assert sample_w["ttft_s"] == pytest.approx(FIRST + PREFILL * (len(w) - hit))
            assert (sample_c["hit_tokens"], sample_c["queried_tokens"]) == (0, len(c))
            assert (sample_w["hit_tokens"], sample_w["queried_tokens"]) == (hit, len(w))
            assert sample_w["prompt_tokens"] == len(w)
        # the prefix sized by the server's own counts: within a history line of the context asked for
        assert abs(r["prompt_tokens"] - r["context"]) <= 4
        assert r["cold_over_warm"] == pytest.approx(r["cold_ttft_s"] / r["warm_ttft_s"]) and r["cold_over_warm"] > 1.5
        assert r["warm_hit_rate"] > 0.9 and r["cold_hit_rate"] == 0
    # two sessions never share a first line: each cold turn is cold
    firsts = {b["messages"][0]["content"].split("\n")[0] for b in measured[0::2]}
    assert len(firsts) == len(measured) // 2
    assert report["warnings"] == []
    rc, out, _ = _run(capsys, "http://a:1/v1", "--agent", "--contexts", "512", "--runs", "1", "-q")
    assert rc == 0 and out.splitlines()[1].split()[:2] == ["context", "prompt"]
    assert out.splitlines()[2].split()[0] == "512" and out.splitlines()[2].endswith("%")


def test_a_server_without_prefix_caching_says_so(monkeypatch, capsys):
    agent_network(monkeypatch, cache=False)
    rc, out, _ = _run(capsys, "http://a:1/v1", "--agent", "--contexts", "512", "--runs", "1", "--json", "-q")
    report = json.loads(out)
    assert rc == 0 and report["results"][0]["warm_hit_rate"] is None
    assert report["warnings"] == ["512 tokens: the server looked nothing up in a prefix cache (caching off): warm "
                                  "TTFT is a cold one"]


@pytest.mark.parametrize("argv, says", [
    (["--contexts", "8q"], "--contexts 8q: give token counts"),
    (["--contexts", "0"], "--contexts 0: give token counts"),
    (["--contexts", "4k"], "--contexts 4096: longer than the server's max_model_len 2048"),
    (["--runs", "0"], "argument --runs: must be between 1 and 1,000, got 0"),
    (["--contexts", "20000k"], "--contexts 20000k: 20000k is more than 16,777,216 tokens"),
    (["--compare", "a.json", "b.json"], "--agent measures one server"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, argv, says):
    agent_network(monkeypatch, max_model_len=2048)
    urls = [] if "--compare" in argv else ["http://a:1/v1"]
    rc, out, err = _run(capsys, *urls, "--agent", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and not out and len(lines) == 1 and says in lines[0], err


def test_contexts_parse_with_k_as_1024():
    assert parse_contexts("8k, 32K,64k") == [8192, 32768, 65536] and parse_contexts("1000") == [1000]


@pytest.mark.slow
def test_streams_at_once_on_the_http_standin(standin, capsys):
    """Two sessions at once over real sockets: every warm turn finds its session's prefix cached."""
    url = standin("--tokens", "4")
    rc, out, _ = _run(capsys, url, "--agent", "--contexts", "512,1k", "--runs", "2", "--concurrency", "2", "--json",
                      "-q")
    assert rc == 0
    report = json.loads(out)
    for r in report["results"]:
        assert [s["stream"] for s in r["streams"]] == [1, 2] and all(s["cold_ttft_s"] for s in r["streams"])
        assert r["cold_hit_rate"] == 0 and r["warm_hit_rate"] > 0.9
        for warm in r["samples"]["warm"]:  # a round's counters: both streams' prompts looked up
            assert warm[0]["queried_tokens"] == sum(t["prompt_tokens"] for t in warm)
