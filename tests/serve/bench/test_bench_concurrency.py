"""bench --concurrency (N streams at once, each its own request) and bench --api-key.

Exact figures come from a lock-step fake server in process (``LockstepNetwork``): every stream's
chunks are released one engine step at a time, and the clock moves one tick only when every open
stream has asked for its next chunk, so each stream reads the same time for the same tick on any
machine. It also holds every request until all N of a round have arrived: a bench that sent them
one after the other breaks that barrier instead of passing. Each workload gets its own drafter
(accepted tokens per draft), so each stream has its own acceptance. The stand-in HTTP server
(``standin_server.py``) checks the same against real sockets and threads, asserting only on
counts, which do not depend on speed.
"""
from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.serve.bench import bench as bench_mod

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from standin_server import Engine, FakeNetwork, FakeServer, _Body, use_network  # noqa: E402

KEY = "sk-test-7f3a9c"  # what must never be printed
TICK = 0.01
FIRST_TICKS = 3  # the first token comes 3 ticks after the request
# per workload: accepted tokens per draft of 4 (a drafter each), so each stream has its own acceptance
ACCEPTED = {"prose": 1, "code": 3, "counting": 4, "agent": 0}
TOKENS = 21  # 1 + 20: 20 decode tokens = 10 steps of 2, 5 of 4, 4 of 5, 20 of 1: no step cut at max_tokens


class Lockstep:
    """A clock for the streams of one round: one tick when every open stream waits for its next
    chunk. A stream's thread reads the time of its own last tick (``perf_counter``)."""

    def __init__(self, tick: float = TICK):
        self.cond = threading.Condition()
        self.now, self.tick = 1000.0, tick
        self.open = self.waiting = self.gen = 0
        self.local = threading.local()

    def perf_counter(self) -> float:
        return getattr(self.local, "now", self.now)

    def enter(self) -> None:
        with self.cond:
            self.open += 1

    def step(self) -> None:
        with self.cond:
            gen = self.gen
            self.waiting += 1
            if self.waiting == self.open:
                self._advance()
            elif not self.cond.wait_for(lambda: self.gen != gen, timeout=60):
                raise RuntimeError("lock-step clock stalled")
            self.local.now = self.now

    def leave(self) -> None:
        with self.cond:
            self.open -= 1
            if self.open and self.waiting == self.open:
                self._advance()

    def _advance(self) -> None:
        self.now += self.tick
        self.waiting = 0
        self.gen += 1
        self.cond.notify_all()


class LockstepNetwork:
    """``urlopen`` for lock-step servers by host: ``/v1/models``, ``/metrics`` (the sum of every
    workload's drafter counters, as one server's) and streamed chat completions."""

    def __init__(self, hosts: tuple[str, ...], concurrency: int, tick: float = TICK, accepted: dict | None = None,
                 key: str | None = None, merge: int = 1, max_seqs: int | None = None):
        self.clock = Lockstep(tick)
        accepted = accepted or ACCEPTED
        self.engines = {h: {w: Engine(spec_tokens=4, accepted=(accepted[w],)) for w in bench_mod.WORKLOADS}
                        for h in hosts}
        self.arrivals = threading.Barrier(concurrency, timeout=60)
        self.key, self.merge = key, merge  # merge: decode steps per chunk (a server that falls behind)
        # max_seqs: the sequences the server runs at once (vLLM's --max-num-seqs); the rest wait, a tick at a time
        self.max_seqs, self.running = max_seqs, 0
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # every request: host, path, Authorization, body
        self.order: list[str] = []

    @staticmethod
    def workload_of(body: dict) -> tuple[str, str]:
        """The bank's workload a request asks for, and what comes before its first user message."""
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        for name, w in bench_mod.WORKLOADS.items():
            bank = next(m["content"] for m in w.messages if m["role"] == "user")
            if user.endswith(bank):
                return name, user[:-len(bank)]
        raise AssertionError(f"not a bank request: {user[:60]}")

    def urlopen(self, req, timeout=None):
        url = req if isinstance(req, str) else req.full_url
        parts = urlsplit(url)
        auth = None if isinstance(req, str) else req.get_header("Authorization")
        body = json.loads(req.data) if not isinstance(req, str) and req.data else None
        with self.lock:
            self.requests.append({"host": parts.netloc, "path": parts.path, "auth": auth, "body": body})
        if self.key and auth != f"Bearer {self.key}":
            raise urllib.error.HTTPError(url, 401, "Unauthorized", {}, None)
        engines = self.engines[parts.netloc]
        if parts.path == "/v1/models":
            return _Body(json.dumps({"data": [{"id": "qwen"}]}).encode())
        if parts.path == "/metrics":
            return _Body("".join(e.render() for e in engines.values()).encode())
        assert parts.path == "/v1/chat/completions"
        with self.lock:
            self.order.append(parts.netloc)
        engine = engines[self.workload_of(body)[0]]
        self.clock.enter()
        self.arrivals.wait()  # all N requests of the round are in flight before any token
        return _Body(lines=self._stream(engine, min(TOKENS, body["max_tokens"])))

    def _stream(self, engine: Engine, n: int):
        sent = pending = 0
        while self.max_seqs:
            with self.lock:
                if self.running < self.max_seqs:
                    self.running += 1
                    break
            self.clock.step()  # queued: time passes, no token
        steps = engine.steps(n)
        for i, (tokens, accepted) in enumerate(steps):
            for _ in range(FIRST_TICKS if i == 0 else 1):
                self.clock.step()
            engine.record(tokens, accepted, 10 if i == 0 else 0)
            sent += tokens
            pending += tokens
            if i and i % self.merge and i < len(steps) - 1:
                continue
            event = {"choices": [{"index": 0, "delta": {"content": "x" * pending}}],
                     "usage": {"completion_tokens": sent}}
            pending = 0
            yield f"data: {json.dumps(event)}\n".encode()
            yield b"\n"
        with self.lock:
            self.running -= 1  # before leaving: a queued stream takes the slot at the next tick
        self.clock.leave()
        yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': sent}})}\n".encode()
        yield b"data: [DONE]\n"


def lockstep(monkeypatch, hosts=("s",), concurrency=4, **kw) -> LockstepNetwork:
    net = LockstepNetwork(hosts, concurrency, **kw)
    monkeypatch.setattr(bench_mod.time, "perf_counter", net.clock.perf_counter)
    use_network(monkeypatch, net.urlopen)
    return net


def expected(workload: str, tick: float = TICK) -> dict:
    """A stream's figures from the lock-step server's known behaviour."""
    steps = 20 // (ACCEPTED[workload] + 1)
    return {"steps": steps, "window": (FIRST_TICKS * tick, (FIRST_TICKS + steps) * tick),
            "decode_tok_s": 20 / (steps * tick), "e2e_tok_s": TOKENS / ((FIRST_TICKS + steps) * tick),
            "length": 20 / steps}


# ---- N streams at once, on the lock-step clock ---------------------------------------------------------

def test_four_streams_at_once_each_with_its_own_workload(monkeypatch):
    net = lockstep(monkeypatch, concurrency=4)
    report = bench_mod.bench("http://s/v1", runs=2, max_tokens=TOKENS, concurrency=4)
    names = list(bench_mod.WORKLOADS)
    assert report["concurrency"] == 4 and report["runs"] == 2 and report["speculative"]
    assert [bench_mod.row_name(r) for r in report["results"]] == [f"{i + 1}:{n}" for i, n in enumerate(names)]
    # every round's four requests ask for the four workloads, each the bank's own prompt
    chats = [r["body"] for r in net.requests if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 3 * 4  # a warm-up round and two measured
    for k in range(3):
        assert sorted(net.workload_of(b) for b in chats[4 * k:4 * k + 4]) == sorted((n, "") for n in names)

    exp = {n: expected(n) for n in names}
    common = min(e["window"][1] for e in exp.values()) - FIRST_TICKS * TICK  # all decoding until counting ends
    for r in report["results"]:
        e = exp[r["workload"]]
        assert r["runs"] == 2 and r["tokens"] == TOKENS and r["variant"] == 1
        assert r["ttft_s"] == pytest.approx(FIRST_TICKS * TICK)
        assert r["decode_tok_s"] == pytest.approx(e["decode_tok_s"])
        assert r["e2e_tok_s"] == pytest.approx(e["e2e_tok_s"])
        assert r["overlap"] == pytest.approx(common / (e["window"][1] - e["window"][0]))
        for s in r["samples"]:
            assert s["stream"] == r["stream"] and s["steps"] == e["steps"]
            assert (s["first_s"], s["last_s"]) == pytest.approx(e["window"]) and s["start_s"] == 0
        acc = r["acceptance"]
        assert acc["basis"] == "tokens per streamed chunk" and acc["drafts"] == 2 * e["steps"]
        assert acc["mean_acceptance_length"] == pytest.approx(e["length"])
        assert acc["draft_acceptance_rate"] == pytest.approx((e["length"] - 1) / 4)
    # what the per-stream figures rest on: the streams' chunk steps are exactly the counters' drafts
    steps = sum(e["steps"] for e in exp.values())
    agg = report["aggregate"]
    assert agg["acceptance_basis"]["one_chunk_per_step"]
    assert agg["acceptance_basis"]["chunk_steps"] == agg["acceptance_basis"]["drafts"] == 2 * steps
    accepted = sum(e["steps"] * ACCEPTED[n] for n, e in exp.items())
    assert agg["acceptance"]["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    wall = max(e["window"][1] for e in exp.values())
    assert agg["total_tok_s"] == pytest.approx(4 * TOKENS / wall)
    decode = [e["decode_tok_s"] for e in exp.values()]
    assert agg["mean_decode_tok_s"] == pytest.approx(sum(decode) / 4)
    assert agg["min_decode_tok_s"] == pytest.approx(min(decode))
    assert agg["all_decoding_s"] == pytest.approx(common)
    assert agg["overlap"]["min"] == pytest.approx(common / (exp["agent"]["window"][1] - FIRST_TICKS * TICK))
    assert agg["overlap"]["min_stream"] == "4:agent"
    assert [r["chunk_steps"] for r in report["rounds"]] == [steps, steps]
    # the agent stream decoded 20% of its window with all four running, and its drafter lands nothing
    assert any(w.startswith("stream 4:agent decoded only 20%") for w in report["warnings"])
    assert any(w.startswith("streams 4:agent: the drafter lands fewer") for w in report["warnings"])
    text = bench_mod.table(report)
    assert "4 streams at once" in text and "4:agent" in text and "overlap %" in text
    assert "checked: the streams' " in text and "are the counters'" in text


def test_more_streams_than_workloads_send_different_prompts(monkeypatch):
    net = lockstep(monkeypatch, concurrency=3)
    report = bench_mod.bench("http://s/v1", runs=1, max_tokens=TOKENS, workloads=["counting"], concurrency=3)
    assert [bench_mod.row_name(r) for r in report["results"]] == ["1:counting", "2:counting", "3:counting"]
    assert [r["variant"] for r in report["results"]] == [1, 2, 3]
    chats = [r["body"] for r in net.requests if r["path"] == "/v1/chat/completions"]
    prefixes = sorted(net.workload_of(b)[1] for b in chats[-3:])
    assert prefixes == ["", "Request 2. ", "Request 3. "]
    # the same drafter on all three: the same exact figures, and full overlap
    for r in report["results"]:
        assert r["decode_tok_s"] == pytest.approx(expected("counting")["decode_tok_s"]) and r["overlap"] == 1.0
    assert not any("decoded only" in w for w in report["warnings"])


def test_a_server_running_fewer_sequences_than_streams_is_said_to_queue(monkeypatch):
    """Found against a real vLLM (the tiny profile's max_num_seqs is 2): with 4 streams, two decode
    while two wait in the queue. The peak of streams decoding at once is 2 in every round, the
    report says the figures are not 4-stream speed, and the queued streams' TTFTs show the wait."""
    lockstep(monkeypatch, concurrency=4, max_seqs=2)
    report = bench_mod.bench("http://s/v1", runs=2, max_tokens=TOKENS, workloads=["counting"], concurrency=4)
    assert [r["peak_decoding"] for r in report["rounds"]] == [2, 2]
    assert report["aggregate"]["peak_decoding"] == 2 and report["aggregate"]["all_decoding_s"] == 0
    assert any(w.startswith("at most 2 of the 4 streams were decoding at once") for w in report["warnings"])
    ttfts = sorted(s["ttft_s"] for r in report["results"] for s in r["samples"])
    steps = expected("counting")["steps"]
    # two per round first; two after a running stream's last step (FIRST_TICKS + steps ticks), then FIRST_TICKS more
    assert ttfts[:4] == pytest.approx([FIRST_TICKS * TICK] * 4)
    assert min(ttfts[4:]) >= (2 * FIRST_TICKS + steps) * TICK - 1e-9
    # the same server with room for all four: no such warning
    lockstep(monkeypatch, concurrency=4, max_seqs=4)
    report = bench_mod.bench("http://s/v1", runs=1, max_tokens=TOKENS, workloads=["counting"], concurrency=4)
    assert report["aggregate"]["peak_decoding"] == 4
    assert not any(w.startswith("at most") for w in report["warnings"])


def test_peak_decoding_arithmetic():
    assert bench_mod.peak_decoding([(0.0, 1.0), (0.5, 2.0), (0.25, 0.75)]) == 3
    assert bench_mod.peak_decoding([(0.0, 1.0), (1.0, 2.0)]) == 1  # one ends as the next starts
    assert bench_mod.peak_decoding([(0.0, 1.0), (0.5, 0.5)]) == 1  # one token: never decoding
    assert bench_mod.peak_decoding([]) == 0


def test_merged_steps_are_said_to_read_high(monkeypatch):
    """A server that sends two engine steps per chunk: the streams' chunk steps fall short of the
    counters' drafts, and the report says the per-stream figures read high."""
    lockstep(monkeypatch, concurrency=2, merge=2)
    report = bench_mod.bench("http://s/v1", runs=1, max_tokens=TOKENS, workloads=["prose", "code"], concurrency=2)
    basis = report["aggregate"]["acceptance_basis"]
    assert not basis["one_chunk_per_step"]
    assert (basis["chunk_steps"], basis["drafts"]) == (5 + 3, 10 + 5)  # 10 steps in 5 chunks, 5 in 3
    assert [r["acceptance"]["mean_acceptance_length"] for r in report["results"]] == [20 / 5, 20 / 3]
    assert any(w.startswith("per-stream acceptance: ") and w.endswith("read high") for w in report["warnings"])


@pytest.mark.parametrize("chunk_steps, drafts, one, ends", [(12, 12, True, "the counters' 12 drafts"),
                                                            (9, 12, False, "read high"), (15, 12, False, "read low")])
def test_acceptance_basis_says_which_way(chunk_steps, drafts, one, ends):
    basis = bench_mod.acceptance_basis(chunk_steps, drafts)
    assert basis["one_chunk_per_step"] is one and basis["text"].endswith(ends)


def test_overlap_arithmetic():
    common, shares = bench_mod.overlaps([(0.0, 1.0), (0.5, 2.0), (0.25, 0.75)])
    assert common == 0.25 and shares == [0.25, 0.25 / 1.5, 0.5]
    assert bench_mod.overlaps([(0.0, 1.0), (2.0, 3.0)]) == (0.0, [0.0, 0.0])  # one after the other
    # a stream of one token never decodes: the others never had all N decoding
    assert bench_mod.overlaps([(0.0, 1.0), (0.5, 0.5)]) == (0.0, [0.0, None])


def test_a_b_rounds_interleave_and_compare_per_stream(monkeypatch):
    net = lockstep(monkeypatch, hosts=("a", "b"), concurrency=2)
    comparison = bench_mod.bench_pair("http://a/v1", "http://b/v1", runs=3, max_tokens=TOKENS,
                                      workloads=["prose", "code"], concurrency=2)
    assert net.order == ["a", "a", "b", "b"] * 4  # warm-up round on each, then A, B, A, B...
    assert comparison["concurrency"] == 2 and comparison["a"]["concurrency"] == 2
    assert [bench_mod.row_name(w) for w in comparison["workloads"]] == ["1:prose", "2:code"]
    for w in comparison["workloads"]:
        assert all(m["verdict"] == "within noise" for m in w["metrics"])  # identical servers, identical runs
    assert [m["metric"] for m in comparison["aggregate"]["metrics"]] == ["total_tok_s", "mean_decode_tok_s",
                                                                        "min_decode_tok_s"]
    assert comparison["flags"] == []
    assert "all streams" in bench_mod.compare_table(comparison)


def _saved(monkeypatch, tmp_path, name: str, concurrency: int, tick: float = TICK, accepted=None) -> Path:
    if concurrency == 1:
        clock = [0.0]
        net = FakeNetwork({"s": FakeServer(clock, Engine(spec_tokens=4, accepted=(3,)), tokens=TOKENS)})
        monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: clock[0])
        use_network(monkeypatch, net.urlopen)
    else:
        lockstep(monkeypatch, concurrency=concurrency, tick=tick, accepted=accepted)
    path = tmp_path / name
    assert main(["bench", "http://s/v1", "--runs", "3", "--max-tokens", str(TOKENS), "--workloads", "prose,code",
                 "--concurrency", str(concurrency), "--out", str(path), "-q"]) == 0
    return path


def test_compare_refuses_results_of_different_concurrency(monkeypatch, tmp_path, capsys):
    one = _saved(monkeypatch, tmp_path, "one.json", 1)
    two = _saved(monkeypatch, tmp_path, "two.json", 2)
    capsys.readouterr()
    assert main(["bench", "--compare", str(one), str(two)]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("error: A ran 1 stream(s) at once and B 2: compare results of the same "
                            "--concurrency\n") and captured.out == ""
    assert main(["bench", "--compare", str(two), str(two), "--concurrency", "2"]) == 2
    assert "--compare reads it from the two results" in capsys.readouterr().err


def test_compare_saved_results_of_the_same_concurrency(monkeypatch, tmp_path, capsys):
    """B ticks every 8 ms against A's 10 ms and its prose drafter lands nothing: every stream is
    faster by exactly 25% in decode, and prose is flagged."""
    a = _saved(monkeypatch, tmp_path, "a.json", 2)
    b = _saved(monkeypatch, tmp_path, "b.json", 2, tick=0.008, accepted={**ACCEPTED, "prose": 0})
    capsys.readouterr()
    assert main(["bench", "--compare", str(a), str(b), "--json"]) == 1
    comparison = json.loads(capsys.readouterr().out)
    code = next(w for w in comparison["workloads"] if w["workload"] == "code")
    decode = next(m for m in code["metrics"] if m["metric"] == "decode_tok_s")
    assert decode["ratio"] == pytest.approx(1.25) and decode["verdict"] == "B faster by 25.0%"
    assert [f.split(": ")[0] for f in comparison["flags"]] == ["1:prose", "all streams (server-wide counters)"]
    assert comparison["workloads"][0]["acceptance"]["b"]["mean_acceptance_length"] == pytest.approx(1.0)


def test_concurrency_out_of_range_is_one_line(capsys):
    for n in ("0", str(bench_mod.MAX_CONCURRENCY + 1)):
        with pytest.raises(SystemExit) as e:  # argparse's type refuses it before anything starts
            main(["bench", "http://127.0.0.1:9/v1", "--concurrency", n])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "argument --concurrency: must be between 1 and" in err


# ---- N = 1, 2, 4 against the stand-in server ------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_streams_against_the_standin_server(standin, capsys, n):
    """29 tokens, 4 drafted and 3 accepted per step: each stream is the prefill token and 7 chunks
    of 4, whatever the speed, so its tokens per chunk is exactly 4.0, and the chunks of all
    streams are exactly the counters' drafts. N = 1 is today's report."""
    url = standin("--tokens", "29", "--spec-tokens", "4", "--accepted", "3")
    assert main(["bench", url, "--runs", "2", "--max-tokens", "29", "--concurrency", str(n), "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["concurrency"] == n and report["speculative"]
    if n == 1:
        assert "aggregate" not in report and "rounds" not in report
        assert all("stream" not in r and "overlap" not in r for r in report["results"])
        assert [r["acceptance"]["mean_acceptance_length"] for r in report["results"]] == [4.0] * 4
        return
    assert [r["stream"] for r in report["results"]] == list(range(1, n + 1))
    assert [r["workload"] for r in report["results"]] == list(bench_mod.WORKLOADS)[:n]
    for r in report["results"]:
        assert r["tokens"] == 29 and len(r["samples"]) == 2
        assert [s["steps"] for s in r["samples"]] == [7, 7]
        assert r["acceptance"]["mean_acceptance_length"] == 4.0 and r["acceptance"]["draft_acceptance_rate"] == 0.75
        for s in r["samples"]:
            assert 0 <= s["overlap"] <= 1 and s["start_s"] <= s["first_s"] <= s["last_s"] <= s["end_s"]
    basis = report["aggregate"]["acceptance_basis"]
    assert basis["one_chunk_per_step"] and basis["chunk_steps"] == basis["drafts"] == 2 * 7 * n
    assert report["aggregate"]["acceptance"]["mean_acceptance_length"] == 4.0
    assert len(report["rounds"]) == 2 and all(r["tokens"] == 29 * n for r in report["rounds"])
    assert 0 <= report["aggregate"]["overlap"]["min"] <= 1


# ---- the API key --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("via", ["flag", "env"])
def test_the_key_goes_on_every_request_and_is_never_printed(monkeypatch, capsys, tmp_path, n, via):
    net = lockstep(monkeypatch, concurrency=n, key=KEY)
    if via == "env":
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        flag = []
    else:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        flag = ["--api-key", KEY]
    out = tmp_path / "r.json"
    assert main(["bench", "http://s/v1", "--runs", "1", "--max-tokens", str(TOKENS), "--workloads", "code,prose",
                 "--concurrency", str(n), "--json", "--out", str(out), "-vv", *flag]) == 0
    paths = {r["path"] for r in net.requests}
    assert paths == {"/v1/models", "/metrics", "/v1/chat/completions"}
    assert all(r["auth"] == f"Bearer {KEY}" for r in net.requests)
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err + out.read_text()


def test_no_key_no_header(monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    net = lockstep(monkeypatch, concurrency=1)
    assert main(["bench", "http://s/v1", "--runs", "1", "--max-tokens", str(TOKENS), "--workloads", "code",
                 "-q"]) == 0
    assert net.requests and all(r["auth"] is None for r in net.requests)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("key", [None, "sk-wrong-1234"], ids=["no-key", "wrong-key"])
def test_a_refused_key_is_one_line_and_exit_2(standin, monkeypatch, capsys, n, key):
    url = standin("--tokens", "8", key=KEY)  # wants KEY, as vLLM given VLLM_API_KEY
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    flag = ["--api-key", key] if key else []
    # --model skips /v1/models, so that the chat requests themselves (N threads) meet the 401;
    # -vv adds the traceback, never the key
    for model in ([], ["--model", "qwen"]):
        for verbose in ([], ["-vv"]):
            rc = main(["bench", url, "--runs", "1", "--max-tokens", "8", "--concurrency", str(n), *verbose, *model,
                       *flag])
            captured = capsys.readouterr()
            printed = captured.out + captured.err
            lines = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
            assert rc == 2 and len(lines) == 1 and (verbose or captured.err == lines[0] + "\n")
            assert "(HTTP 401): give --api-key or OPENAI_API_KEY" in lines[0] and url in lines[0]
            assert KEY not in printed and (key is None or key not in printed)
    rc = main(["bench", url, "--runs", "1", "--max-tokens", "8", "--concurrency", str(n), "--api-key", KEY, "-q"])
    assert rc == 0


# ---- the one at_once (bench's streams and bench --agent's sessions) -----------------------------------

def test_a_thread_that_cannot_start_ends_the_ones_started(monkeypatch):
    """The third thread's start fails (as under a thread limit): the two started ones, waiting at the
    barrier for it, are released by the abort and end; no call runs; the start's error is raised."""
    made: list[threading.Thread] = []

    class Failing(threading.Thread):
        def start(self):
            made.append(self)
            if len(made) == 3:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(bench_mod.threading, "Thread", Failing)
    ran = []
    with pytest.raises(RuntimeError, match="can't start new thread"):
        bench_mod.at_once([lambda i=i: ran.append(i) for i in range(4)])
    for t in made[:2]:
        t.join(timeout=60)  # a safety net only: the abort ends them at once
    assert len(made) == 3 and not any(t.is_alive() for t in made[:2]) and ran == []


def test_at_once_returns_in_order_and_raises_the_refused_key_first():
    release = threading.Barrier(3)  # every call waits for the others: they run at once or not at all

    def call(i):
        release.wait(timeout=60)
        return i * 10

    assert bench_mod.at_once([lambda i=i: call(i) for i in range(3)]) == [0, 10, 20]
    from hybrid_build.core.errors import KeyRefused

    def fails(e):
        raise e

    with pytest.raises(KeyRefused):
        bench_mod.at_once([lambda: fails(RuntimeError("other")), lambda: fails(KeyRefused("key"))])
