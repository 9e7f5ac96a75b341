"""``bench --trace``: the three trace formats, malformed and locked inputs, the replay against the
stand-in server (a real process that records every chat request it answers), the synthetic trace
and the soak.

The replay's figures are checked against what the stand-in recorded (prompts, cached tokens, tool
calls), never against times; the soak runs on a fake clock (each reading one second later) and is
checked on counts.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.serve.bench import bench_trace
from hybrid_build.serve.bench import soak as soak_mod
from hybrid_build.serve.bench.trace_formats import read_trace
from hybrid_build.serve.bench.trace_report import TurnResult, check_tool_calls, parse_slo, percentile, summarize
from hybrid_build.serve.bench.trace_synthetic import generate, parse_spec, stated

HERE = Path(__file__).resolve().parent.parent
STANDIN = HERE / "standin_server.py"
SECRET = "SECRET-CONTENT-7f3a"  # in every message of the traces: it must never be printed

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "terminal", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def _call(cid: str, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def conversation(n: int) -> list[dict]:
    """A coding-agent conversation: 4 assistant turns, 2 of them tool calls."""
    return [{"role": "system", "content": f"You are an agent {SECRET}"},
            {"role": "user", "content": f"fix the test {n} {SECRET}"},
            _call(f"c{n}a", "terminal", {"command": f"pytest {SECRET}"}),
            {"role": "tool", "tool_call_id": f"c{n}a", "content": f"1 failed {SECRET}"},
            _call(f"c{n}b", "read_file", {"path": "stats.py"}),
            {"role": "tool", "tool_call_id": f"c{n}b", "content": f"def median(): {SECRET}"},
            {"role": "assistant", "content": f"The median was wrong {SECRET}"},
            {"role": "user", "content": f"thanks, now the docs {SECRET}"},
            {"role": "assistant", "content": f"Done {SECRET}"}]


def write_openai(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": f"conv-{i}", "messages": conversation(i), "tools": TOOLS}) + "\n"
                            for i in range(n)))
    return path


def write_vllm(path: Path, n: int = 3) -> Path:
    """vLLM's multi-turn file: a JSON array of {"id", "messages"} with user/assistant turns."""
    items = [{"id": f"CONV_ID_{i}", "messages": [
        {"role": "user", "content": f"{i} is a nice number... {SECRET}"},
        {"role": "assistant", "content": f"answer one {SECRET}"},
        {"role": "user", "content": f"more {SECRET}"},
        {"role": "assistant", "content": f"answer two {SECRET}"}]} for i in range(n)]
    path.write_text(json.dumps(items, indent=2))
    return path


# The tables a replay reads, with every column hermes-agent's SCHEMA_SQL (hermes_state_common.py,
# SCHEMA_VERSION 30) gives them.
HERMES_DDL = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE system_prompts (hash TEXT PRIMARY KEY, prompt TEXT NOT NULL);
CREATE TABLE sessions (
    id TEXT PRIMARY KEY, source TEXT NOT NULL, created_source TEXT, user_id TEXT, session_key TEXT, chat_id TEXT,
    chat_type TEXT, thread_id TEXT, display_name TEXT, origin_json TEXT, expiry_finalized INTEGER DEFAULT 0,
    model TEXT, model_config TEXT, system_prompt TEXT, system_prompt_hash TEXT, parent_session_id TEXT,
    started_at REAL NOT NULL, ended_at REAL, end_reason TEXT, message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0, input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0,
    cache_read_tokens INTEGER DEFAULT 0, cache_write_tokens INTEGER DEFAULT 0, reasoning_tokens INTEGER DEFAULT 0,
    cwd TEXT, git_branch TEXT, git_repo_root TEXT, git_metadata_generation INTEGER NOT NULL DEFAULT 0,
    billing_provider TEXT, billing_base_url TEXT, billing_mode TEXT, estimated_cost_usd REAL, actual_cost_usd REAL,
    cost_status TEXT, cost_source TEXT, pricing_version TEXT, title TEXT, title_source TEXT, last_activity_at REAL,
    last_activity_description TEXT, last_activity_provenance TEXT, api_call_count INTEGER DEFAULT 0,
    handoff_state TEXT, handoff_platform TEXT, handoff_error TEXT, compression_failure_cooldown_until REAL,
    compression_failure_error TEXT, compression_fallback_streak INTEGER NOT NULL DEFAULT 0,
    compression_ineffective_count INTEGER NOT NULL DEFAULT 0, compression_recovery_deadline REAL,
    compression_overload_streak INTEGER NOT NULL DEFAULT 0, profile_name TEXT, transport_profile TEXT,
    rewind_count INTEGER NOT NULL DEFAULT 0, archived INTEGER NOT NULL DEFAULT 0, pinned INTEGER NOT NULL DEFAULT 0,
    hidden INTEGER NOT NULL DEFAULT 0, last_read_at REAL, tool_names TEXT,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id),
    FOREIGN KEY (system_prompt_hash) REFERENCES system_prompts(hash));
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), role TEXT NOT NULL,
    content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT, effect_disposition TEXT,
    timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT, reasoning TEXT, reasoning_content TEXT,
    reasoning_details TEXT, codex_reasoning_items TEXT, codex_message_items TEXT, platform_message_id TEXT,
    observed INTEGER DEFAULT 0, _compressed_summary INTEGER NOT NULL DEFAULT 0, active INTEGER NOT NULL DEFAULT 1,
    compacted INTEGER NOT NULL DEFAULT 0, api_content TEXT, display_kind TEXT, display_metadata TEXT,
    display_identity BLOB, display_order INTEGER);
"""


def write_hermes(path: Path, n: int = 3, tool_calls_text=None) -> Path:
    """A state.db as Hermes writes it: the system prompt shared by hash, tool_calls as JSON text,
    one inactive (rewound) message that a replay must skip."""
    con = sqlite3.connect(path)
    con.executescript(HERMES_DDL)
    prompt = f"You are Hermes {SECRET}"
    con.execute("INSERT INTO schema_version VALUES (30)")
    con.execute("INSERT INTO system_prompts VALUES ('h1', ?)", (prompt,))
    for i in range(n):
        sid = f"2026-12-0{i + 1}_session{i}"
        con.execute("INSERT INTO sessions (id, source, started_at, system_prompt_hash, tool_names) "
                    "VALUES (?, 'cli', ?, 'h1', ?)", (sid, 100.0 + i, json.dumps(["terminal", "read_file"])))
        ts = itertools.count(1000.0 + 10 * i)
        for m in conversation(i)[1:]:
            calls = m.get("tool_calls")
            text = tool_calls_text if (tool_calls_text is not None and calls) else (json.dumps(calls) if calls
                                                                                    else None)
            con.execute("INSERT INTO messages (session_id, role, content, tool_calls, tool_call_id, timestamp) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (sid, m["role"], m["content"], text, m.get("tool_call_id"),
                                                      next(ts)))
        con.execute("INSERT INTO messages (session_id, role, content, timestamp, active) VALUES (?, 'user', ?, ?, 0)",
                    (sid, f"rewound {SECRET}", next(ts)))
    con.commit()
    con.close()
    return path


@pytest.fixture
def traces(tmp_path):
    return {"openai": write_openai(tmp_path / "chats.jsonl"), "vllm": write_vllm(tmp_path / "conv.json"),
            "hermes": write_hermes(tmp_path / "state.db")}


# ---- the formats --------------------------------------------------------------------------------------

def test_the_three_formats_read_as_conversations(traces):
    o, v, h = (read_trace(traces[k]) for k in ("openai", "vllm", "hermes"))
    assert (o.format, v.format, h.format) == ("openai-jsonl", "vllm-multiturn", "hermes-state-db")
    assert [c.id for c in o.conversations] == ["conv-0", "conv-1", "conv-2"]
    assert [c.id for c in v.conversations] == ["CONV_ID_0", "CONV_ID_1", "CONV_ID_2"]
    assert [c.id for c in h.conversations] == [f"2026-12-0{i + 1}_session{i}" for i in range(3)]
    for c in o.conversations + h.conversations:
        assert [c.messages[i]["role"] for i in c.assistant_turns] == ["assistant"] * 4
        assert sum(1 for i in c.assistant_turns if c.messages[i].get("tool_calls")) == 2
        assert c.tool_names == {"terminal", "read_file"}
    assert all(len(c.assistant_turns) == 2 for c in v.conversations)
    # the state.db: the shared system prompt first, the rewound (inactive) message left out, the
    # messages as the JSONL has them
    for co, ch in zip(o.conversations, h.conversations):
        assert ch.messages[0] == {"role": "system", "content": f"You are Hermes {SECRET}"}
        assert ch.messages[1:] == co.messages[1:] and ch.tool_names_from == "state.db tool_names"


def test_a_state_db_is_opened_read_only_and_never_modified(traces):
    db = traces["hermes"]
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    read_trace(db)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in db.parent.iterdir() if p.name.startswith("state.db")) == ["state.db"]


# ---- malformed inputs: one line, exit 2, no content -------------------------------------------------

def _jsonl(tmp_path, obj) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"id": "conv-0", "messages": conversation(0), "tools": TOOLS}) + "\n"
                 + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return p


def _bad_message(i: int, **change) -> dict:
    msgs = conversation(1)
    msgs[i] = {**msgs[i], **change}
    return {"id": "conv-1", "messages": msgs}


MALFORMED = {
    "not-json-line": (lambda t: _jsonl(t, f'{{"id": "x", "messages": [{SECRET}'),
                      "bad.jsonl: conversation on line 2: not JSON"),
    "line-not-object": (lambda t: _jsonl(t, [SECRET]), "conversation line-2 (line 2): field (line): is a list"),
    "no-messages": (lambda t: _jsonl(t, {"id": "conv-1"}), "conversation conv-1 (line 2): field messages: is null"),
    "empty-messages": (lambda t: _jsonl(t, {"id": "conv-1", "messages": []}), "field messages: is empty"),
    "unknown-role": (lambda t: _jsonl(t, _bad_message(1, role=SECRET)),
                     "conversation conv-1 (line 2): field messages[1].role: is an unknown role"),
    "content-number": (lambda t: _jsonl(t, _bad_message(1, content=12)), "field messages[1].content: is a number"),
    "tool-call-no-name": (lambda t: _jsonl(t, _bad_message(2, tool_calls=[{"function": {"arguments": SECRET}}])),
                          "field messages[2].tool_calls[0].function.name: is null"),
    "tool-args-number": (lambda t: _jsonl(t, _bad_message(2, tool_calls=[{"function": {"name": "x", "arguments": 3}}])),
                         "field messages[2].tool_calls[0].function.arguments: is a number"),
    "tool-no-call-id": (lambda t: _jsonl(t, {"id": "conv-1", "messages": [
        m if m["role"] != "tool" else {"role": "tool", "content": m["content"]} for m in conversation(1)]}),
        "field messages[3].tool_call_id: is null"),
    "user-tool-calls": (lambda t: _jsonl(t, _bad_message(1, tool_calls=[])),
                        "field messages[1].tool_calls: on a user message"),
    "no-assistant": (lambda t: _jsonl(t, {"id": "conv-1", "messages": [{"role": "user", "content": SECRET}]}),
                     "field messages: has no assistant message"),
    "duplicate-id": (lambda t: _jsonl(t, {"id": "conv-0", "messages": conversation(0)}),
                     "conversation conv-0 (line 2): field id: appears on an earlier line too"),
    "tools-not-list": (lambda t: _jsonl(t, {"id": "conv-1", "messages": conversation(1), "tools": SECRET}),
                       "field tools: is a string"),
    "vllm-not-array": (lambda t: (t / "v.json").write_text(f'[{{"id": "a", "messages": [{SECRET}') and t / "v.json",
                       "v.json: item 0: not JSON"),
    "vllm-id-number": (lambda t: (t / "v.json").write_text(json.dumps([{"id": 3, "messages": []}])) and t / "v.json",
                       "v.json: conversation #0 (item 0): field id: is a number"),
    "vllm-generator-config": (lambda t: (t / "v.json").write_text(json.dumps(
        {"filetype": "generate_conversations", "num_conversations": 2})) and t / "v.json",
        "v.json: vLLM's synthetic-conversation config, not conversations"),
    "hermes-tool-calls-not-json": (lambda t: write_hermes(t / "state.db", tool_calls_text=SECRET + "{"),
                                   "field messages.tool_calls: not JSON"),
    "hermes-other-schema": (lambda t: _other_schema(t / "state.db"),
                            "state.db: not a Hermes state.db (table messages lacks timestamp, tool_call_id, "
                            "tool_calls)"),
    "not-a-trace": (lambda t: (t / "x.txt").write_text(SECRET) and t / "x.txt", "x.txt: not a trace"),
    "empty-file": (lambda t: (t / "e.jsonl").write_text("\n\n") and t / "e.jsonl", "e.jsonl: not a trace"),
}


def _other_schema(path: Path) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE sessions (id TEXT, started_at REAL)")
    con.execute("CREATE TABLE messages (id INTEGER, session_id TEXT, role TEXT, content TEXT)")
    con.execute("CREATE TABLE notes (body TEXT)")
    con.execute("INSERT INTO notes VALUES (?)", (SECRET,))
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_trace_is_one_line_exit_2_without_content(tmp_path, capsys, case):
    make, expected = MALFORMED[case]
    path = make(tmp_path)
    before = path.read_bytes()
    rc = main(["bench", "http://127.0.0.1:9/v1", "--trace", str(path)])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err and path.name in captured.err
    assert SECRET not in captured.err and str(tmp_path) not in captured.err
    assert path.read_bytes() == before


def test_a_locked_state_db_is_refused_in_one_line_and_left_alone(traces, capsys):
    db = traces["hermes"]
    before = db.read_bytes()
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")  # a writer holding the file, as an agent mid-commit
    try:
        rc = main(["bench", "http://127.0.0.1:9/v1", "--trace", str(db)])
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    err = capsys.readouterr().err
    assert rc == 3 and err.count("\n") == 1 and "state.db: locked by another process" in err
    assert SECRET not in err and db.read_bytes() == before


# ---- the synthetic trace ------------------------------------------------------------------------------

def test_the_synthetic_trace_has_its_stated_statistics():
    p = parse_spec("agent-synthetic", seed=3)
    t = generate(p)
    s = stated(t, p)
    turns = p.conversations * p.turns
    assert s["measured"]["assistant_turns"] == turns
    assert s["measured"]["tool_call_share"] == round(0.73 * turns) / turns
    lo, hi = s["measured"]["context_words_first_turn"]
    assert 0.9 * p.start <= lo <= hi <= 1.1 * p.start
    lo, hi = s["measured"]["context_words_last_turn"]
    assert 0.9 * p.end <= lo <= hi <= 1.1 * p.end
    assert generate(p) == t and generate(parse_spec("agent-synthetic", seed=4)) != t
    small = parse_spec("agent-synthetic:conversations=2,turns=5,start=200,end=900,call_tokens=5-9", seed=0)
    assert (small.conversations, small.turns, small.call_tokens) == (2, 5, (5, 9))
    assert len(generate(small).conversations) == 2


@pytest.mark.parametrize("spec,line", [("agent-synthetic:turns=x", "turns=x: not a number"),
                                       ("agent-synthetic:speed=3", "unknown parameter 'speed'"),
                                       ("agent-synthetic:start=900,end=100", "end >= start")])
def test_bad_synthetic_parameters_are_one_line(capsys, spec, line):
    assert main(["bench", "http://127.0.0.1:9/v1", "--trace", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err


# ---- the statistics ----------------------------------------------------------------------------------

def test_percentiles_are_nearest_rank():
    vals = list(range(1, 21))  # 1..20
    assert (percentile(vals, 50), percentile(vals, 95), percentile(vals, 100)) == (10, 19, 20)
    assert percentile([3.0], 95) == 3.0 and percentile([], 50) is None


def test_tool_call_validity_needs_all_three():
    offered = frozenset({"read_file"})
    ok = {"function": {"name": "read_file", "arguments": '{"path": "a"}'}}
    assert check_tool_calls([ok], offered).valid
    assert not check_tool_calls([{"function": {"name": "rm", "arguments": "{}"}}], offered).offered
    assert not check_tool_calls([{"function": {"name": "read_file", "arguments": '{"path":'}}], offered).json_args
    assert not check_tool_calls([{"function": {"name": "read_file", "arguments": "[1]"}}], offered).json_args
    assert not check_tool_calls([{"function": {"arguments": "{}"}}], offered).parsed
    deep = "[" * 100_000 + "]" * 100_000  # a server's arguments nested without end: not JSON here, no traceback
    assert not check_tool_calls([{"function": {"name": "read_file", "arguments": deep}}], offered).json_args


def test_goodput_counts_the_turns_within_both_bounds():
    slo = parse_slo("ttft=1,tpot=50ms")
    assert (slo.ttft_s, slo.tpot_s) == (1.0, 0.05)
    turns = [TurnResult("c", 1, ttft_s=0.5, decode_s=1.0, decode_tokens=40, completion_tokens=41, total_s=1.5),
             TurnResult("c", 2, ttft_s=1.5, decode_s=1.0, decode_tokens=40, completion_tokens=41, total_s=2.5),
             TurnResult("c", 3, ttft_s=0.5, decode_s=1.0, decode_tokens=10, completion_tokens=11, total_s=1.5),
             TurnResult("c", 4, error="http 500")]
    g = summarize(turns, 10.0, slo)["goodput"]
    assert (g["good"], g["share"], g["per_s"]) == (1, 0.25, 0.1)


def test_a_restart_is_a_new_start_time_or_a_counter_going_back():
    a = {"gone": False, "start": 1.0, "vllm:prefix_cache_queries": 100.0, "vllm:prompt_tokens": 50.0,
         "vllm:generation_tokens": 10.0}
    assert not bench_trace.restarted(a, {**a, "vllm:prompt_tokens": 60.0})
    assert bench_trace.restarted(a, {**a, "start": 2.0})
    assert bench_trace.restarted(a, {**a, "start": None, "vllm:prompt_tokens": 5.0} | {"start": 1.0})
    assert bench_trace.delta(a, {**a, "start": 2.0}) is None


# ---- the replay against the stand-in ------------------------------------------------------------------

def _recorded(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["openai", "vllm", "hermes"])
def test_the_replay_sends_the_recorded_history_and_reports_what_the_standin_answered(standin, traces, tmp_path,
                                                                                     capsys, fmt):
    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "9", "--spec-tokens", "3", "--accepted", "2", "--record", str(rec),
                  "--first-delay", "0", "--token-delay", "0")
    out = tmp_path / "r.json"
    assert main(["bench", url, "--trace", str(traces[fmt]), "--concurrency", "2", "--json", "-q", "--out",
                 str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    trace = read_trace(traces[fmt])
    sent = _recorded(rec)
    # one request per assistant turn, and each carries the recorded history up to that turn
    expected = sorted(json.dumps(list(c.messages[:i])) for c in trace.conversations for i in c.assistant_turns)
    assert sorted(json.dumps(r["request"]["messages"]) for r in sent) == expected
    assert all(r["request"]["temperature"] == 0 and r["request"]["stream"] for r in sent)
    o = report["overall"]
    assert o["requests"] == len(sent) and o["errors"] == {}
    assert o["completion_tokens"] == sum(r["answer"]["completion_tokens"] for r in sent)
    assert o["prompt_tokens"] == sum(r["answer"]["prompt_tokens"] for r in sent)
    hit = sum(r["answer"]["cached_tokens"] for r in sent) / sum(r["answer"]["prompt_tokens"] for r in sent)
    assert o["prefix_cache"]["usage_hit_rate"] == pytest.approx(hit)
    assert o["prefix_cache"]["counter_hit_rate"] == pytest.approx(hit)  # the stand-in alone served them
    calls = [r for r in sent if r["answer"]["tool_call"]]
    assert o["tool_calls"]["answered_with_calls"] == o["tool_calls"]["valid"] == len(calls)
    assert (len(calls) > 0) == (fmt != "vllm")  # vLLM's format offers no tools
    # 9 tokens: the prefill's and 4 steps of 2 accepted + 1 bonus (the last cut to 2): length 3
    assert o["acceptance"]["mean_acceptance_length"] == 3.0
    assert o["tokens_per_step"] == pytest.approx(8 / 3)  # 8 decode tokens in 3 chunks (3, 3, 2)
    assert [p["position"] for p in report["per_position"]] == (["1", "2", "3", "4"] if fmt != "vllm" else ["1", "2"])
    assert sum(p["requests"] for p in report["per_position"]) == o["requests"]
    assert SECRET not in out.read_text()


def test_a_second_run_finds_nothing_the_first_cached(standin, traces, tmp_path, capsys):
    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "4", "--record", str(rec), "--first-delay", "0", "--token-delay", "0")
    cached = []
    for _ in range(2):
        rec.unlink(missing_ok=True)
        assert main(["bench", url, "--trace", str(traces["openai"]), "--json", "-q"]) == 0
        capsys.readouterr()
        sent = _recorded(rec)
        cached.append(sorted((len(r["request"]["messages"]), r["request"]["messages"][1]["content"],
                              r["answer"]["cached_tokens"]) for r in sent))
        assert len({r["request"]["cache_salt"] for r in sent}) == 1
    assert cached[0] == cached[1] and any(c for *_, c in cached[0])


def test_feed_back_generated_sends_the_servers_replies(standin, traces, tmp_path, capsys):
    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "5", "--record", str(rec), "--first-delay", "0", "--token-delay", "0")
    assert main(["bench", url, "--trace", str(traces["openai"]), "--conversations", "1", "--feed-back",
                 "generated", "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["conversations"] == 1 and report["feed_back"] == "generated"
    sent = sorted(_recorded(rec), key=lambda r: len(r["request"]["messages"]))
    assert len(sent) == 4
    for k, r in enumerate(sent[:-1]):
        nxt = sent[k + 1]["request"]["messages"]
        reply = nxt[len(r["request"]["messages"])]  # the assistant message after this request's history
        call = r["answer"]["tool_call"]
        if call:  # the stand-in's call, under the recorded call's id (the recorded tool result answers it)
            assert reply["tool_calls"][0]["function"] == call["function"]
        else:
            assert reply["content"] == "t0 t1 t2 t3 t4 " and "tool_calls" not in reply
        assert SECRET not in json.dumps(reply)


@pytest.mark.parametrize("fault,key", [("name", "not_offered"), ("args", "args_not_json")])
def test_invalid_tool_calls_are_counted(standin, traces, tmp_path, capsys, fault, key):
    import urllib.request

    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "6", "--record", str(rec), "--control", "--first-delay", "0", "--token-delay", "0")
    req = urllib.request.Request(url[:-3] + "/standin/config", data=json.dumps({"tool_fault": fault}).encode(),
                                 method="POST")
    urllib.request.urlopen(req).read()
    assert main(["bench", url, "--trace", str(traces["openai"]), "--json", "-q"]) == 0
    tc = json.loads(capsys.readouterr().out)["overall"]["tool_calls"]
    calls = sum(1 for r in _recorded(rec) if r["answer"]["tool_call"])
    assert calls > 0 and tc["answered_with_calls"] == tc[key] == calls and tc["valid"] == 0


def test_no_tools_sends_no_tool_definitions(standin, traces, tmp_path, capsys):
    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "4", "--record", str(rec), "--first-delay", "0", "--token-delay", "0")
    for flags, with_tools in (([], True), (["--no-tools"], False)):
        rec.unlink(missing_ok=True)
        assert main(["bench", url, "--trace", str(traces["hermes"]), "--max-turns", "2", "--json", "-q", *flags]) == 0
        tc = json.loads(capsys.readouterr().out)["overall"]["tool_calls"]
        sent = _recorded(rec)
        assert len(sent) == 6 and all(("tools" in r["request"]) == with_tools for r in sent)
        # a state.db keeps only the names: sent as definitions without parameters
        assert not with_tools or {t["function"]["name"] for t in sent[0]["request"]["tools"]} == {"terminal",
                                                                                                   "read_file"}
        assert (tc["answered_with_calls"] > 0) == with_tools


def test_ab_with_a_trace_interleaves_two_servers(standin, traces, capsys):
    a = standin("--tokens", "6", "--first-delay", "0", "--token-delay", "0")
    b = standin("--tokens", "6", "--first-delay", "0", "--token-delay", "0")
    assert main(["bench", a, b, "--trace", str(traces["vllm"]), "--runs", "3", "--json", "-q"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert [m["metric"] for m in c["metrics"]] == ["ttft_p50_s", "decode_tok_s", "e2e_tok_s"]
    assert all(len(m["a"]) == len(m["b"]) == 3 for m in c["metrics"][:1])
    assert all(m["verdict"] for m in c["metrics"])
    assert {k: r["overall"]["requests"] for k, r in c["reports"].items()} == {"A": 18, "B": 18}


# ---- the soak -----------------------------------------------------------------------------------------

class FakeClock:
    """Each reading one second after the last: the windows depend on the order of events only."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _start_standin(tmp_path, *flags) -> tuple[subprocess.Popen, str]:
    from serve_cli import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--port", str(port), *flags], stdout=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:  # it says when it listens: no polling
        if "serving on" in line:
            break
    return proc, f"http://127.0.0.1:{port}/v1"


def test_the_soak_loops_and_counts_per_window(tmp_path, traces):
    proc, url = _start_standin(tmp_path, "--tokens", "4", "--first-delay", "0", "--token-delay", "0", "--control",
                               "--spec-tokens", "2", "--accepted", "1")
    try:
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(url[:-3] + "/standin/config", method="POST",
                                                      data=json.dumps({"fail_every": 5}).encode())).read()
        trace = read_trace(traces["vllm"])
        opts = bench_trace.ReplayOptions(concurrency=1, duration=150.0, window=40.0, max_tokens=4)
        r = soak_mod.soak(url, trace, opts, clock=FakeClock())
    finally:
        proc.kill()
        proc.wait()
    rows, o = r["windows"], r["overall"]
    assert r["loops"] >= 2  # 6 turns a loop, each 6+ clock readings: the 150 s pass loops
    assert sum(w["requests"] for w in rows) == o["requests"] == o["ok"] + r["failed_requests"]
    assert r["failed_requests"] == o["requests"] // 5 and all(set(w["errors"]) <= {"http 500"} for w in rows)
    assert sum(sum(w["errors"].values()) for w in rows) == r["failed_requests"]
    assert [w["window"] for w in rows] == list(range(len(rows))) and len(rows) == 4
    assert not any(w["restarted"] or w["server_gone"] for w in rows)
    assert all(w["acceptance_length"] == 2.0 for w in rows if w["requests"] > w.get("errors", {}).get("http 500", 0))
    # per window: the server's generated tokens per second of the window (its counter), the KV cache in use
    assert all(w["decode_tok_s_from"] == "server" and w["kv_usage"] is not None for w in rows)
    generated = [w["decode_tok_s"] * min(opts.window, r["wall_s"] - w["start_s"]) for w in rows]
    assert sum(generated) == pytest.approx(4 * o["ok"])  # 4 tokens a turn that answered, none for a 500
    assert [w["kv_usage"] for w in rows] == sorted(w["kv_usage"] for w in rows)  # the cache only grows
    table = soak_mod.soak_table(r).splitlines()
    assert len(table) == 2 + len(rows) + 3
    assert table[-2] == f"failed: {r['failed_requests']} x http 500: simulated engine error"
    assert table[-1].startswith("fit: 0 of 6 turns are longer than the server's max_model_len 2,048 takes")
    png = soak_mod.draw(r, tmp_path / "soak.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_soak_sees_the_server_disappear(tmp_path, traces):
    proc, url = _start_standin(tmp_path, "--tokens", "3", "--first-delay", "0", "--token-delay", "0")
    gone = []

    def kill_after_third(res):  # ordered by events: the server dies after the third answer
        if len(gone) == 0 and res.turn and proc.poll() is None:
            kill_after_third.n = getattr(kill_after_third, "n", 0) + 1
            if kill_after_third.n == 3:
                proc.kill()
                proc.wait()
                gone.append(True)

    trace = read_trace(traces["vllm"])
    opts = bench_trace.ReplayOptions(concurrency=1, duration=60.0, window=20.0, max_tokens=3, timeout=10)
    try:
        r = soak_mod.soak(url, trace, opts, clock=FakeClock(), on_turn=kill_after_third)
    finally:
        proc.kill()
        proc.wait()
    assert gone and r["overall"]["ok"] == 3 and r["failed_requests"] == r["overall"]["requests"] - 3 > 0
    assert set(itertools.chain.from_iterable(w["errors"] for w in r["windows"])) == {"unreachable"}
    assert r["server_gone_windows"] >= 1


def test_the_soak_sees_the_server_restart(tmp_path, traces):
    """The stand-in is replaced by a new process on the same port after the third answer (ordered by
    events): the window that spans it says RESTARTED (a new process_start_time_seconds, counters back
    at zero), and its counter deltas are not used."""
    flags = ("--tokens", "3", "--first-delay", "0", "--token-delay", "0")
    proc, url = _start_standin(tmp_path, *flags)
    port = url.split(":")[2].split("/")[0]
    procs = [proc]
    answered = []

    def restart_after_third(res):
        answered.append(res)
        if len(answered) == 3:
            procs[-1].kill()
            procs[-1].wait()
            new = subprocess.Popen([sys.executable, str(STANDIN), "--port", port, *flags], stdout=subprocess.PIPE,
                                   text=True)
            procs.append(new)
            for line in new.stdout:
                if "serving on" in line:
                    break

    trace = read_trace(traces["vllm"])
    opts = bench_trace.ReplayOptions(concurrency=1, duration=80.0, window=20.0, max_tokens=3, timeout=10)
    try:
        r = soak_mod.soak(url, trace, opts, clock=FakeClock(), on_turn=restart_after_third)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(procs) == 2 and r["restarts"] == 1 and r["failed_requests"] == 0
    assert sum(w["restarted"] for w in r["windows"]) == 1 and not any(w["server_gone"] for w in r["windows"])


def test_the_soak_exits_1_on_a_failed_request(standin, traces, tmp_path, capsys):
    url = standin("--tokens", "3", "--first-delay", "0", "--token-delay", "0", "--control")
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(url[:-3] + "/standin/config", method="POST",
                                                  data=json.dumps({"fail_every": 2}).encode())).read()
    out = tmp_path / "soak.json"
    rc = main(["bench", url, "--trace", str(traces["vllm"]), "--duration", "0.5", "--window", "0.25", "--out",
               str(out), "-q"])
    captured = capsys.readouterr()
    assert rc == 1 and "request(s) failed" in captured.err and "http 500" in captured.out
    assert json.loads(out.read_text())["failed_requests"] > 0 and (tmp_path / "soak.png").exists()


# ---- hostile servers (hostile_server.py, the client's own tests' child server) ---------------------------

from test_bench_hostile import KEY  # noqa: E402 - the hostile fixture is tests/conftest.py's


@pytest.mark.parametrize("status, on", [("307", "/v1/models"), ("302", "/v1/chat/completions")])
def test_a_replay_follows_no_redirect_and_keeps_the_key(hostile, traces, capsys, tmp_path, status, on):
    seen = tmp_path / "other-port.jsonl"
    other = hostile("models", record=seen)
    url = hostile(status, on=on, location=other)
    rc = main(["bench", url + "/v1", "--trace", str(traces["openai"]), "--concurrency", "3", "--api-key", KEY])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and f"answered HTTP {status}, a redirect" in err
    assert KEY not in out + err and SECRET not in out + err
    assert not seen.exists() or seen.read_text() == ""


def test_a_replay_against_a_gateway_without_a_model_list_is_one_line(hostile, traces, capsys):  # noqa: F811
    url = hostile("gateway", on="/v1/models")
    rc = main(["bench", url + "/v1", "--trace", str(traces["vllm"])])
    err = capsys.readouterr().err
    assert rc == 3 and err.count("\n") == 1 and "answered no model list" in err


# ---- why a request failed, and the turns that cannot fit ---------------------------------------------

def _config(url: str, **knobs) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(url[:-3] + "/standin/config", method="POST",
                                                  data=json.dumps(knobs).encode())).read()


def _prompt_tokens(trace_path: Path) -> list[tuple[str, int, int]]:
    """(conversation, turn, prompt tokens) for every turn, by the stand-in's own tokenizer."""
    from standin_server import chat_token_ids

    return [(c.id, k, len(chat_token_ids({"messages": list(c.messages[:i])})))
            for c in read_trace(trace_path).conversations for k, i in enumerate(c.assistant_turns, 1)]


def test_turns_longer_than_max_model_len_are_said_before_the_replay_with_the_servers_reason(standin, traces,
                                                                                        tmp_path, capsys):
    limit, max_tokens = 28, 4
    counts = _prompt_tokens(traces["openai"])
    too_long = [t for t in counts if t[2] > limit - max_tokens]
    assert 0 < len(too_long) < len(counts)  # the trace straddles the limit: a real check
    rec = tmp_path / "rec.jsonl"
    url = standin("--tokens", "4", "--max-model-len", str(limit), "--record", str(rec), "--first-delay", "0",
                  "--token-delay", "0")
    out = tmp_path / "r.json"
    rc = main(["bench", url, "--trace", str(traces["openai"]), "--max-tokens", str(max_tokens), "--out", str(out)])
    captured = capsys.readouterr()
    longest = max(counts, key=lambda t: t[2])
    note = (f"bench: fit: {len(too_long)} of {len(counts)} turns are longer than the server's max_model_len "
            f"{limit:,} takes (prompt + {max_tokens} completion tokens, counted by its /tokenize); the longest prompt "
            f"is {longest[2]} tokens ({longest[0]}, turn {longest[1]}); they will fail: --skip-too-long leaves them "
            f"out")
    assert rc == 1 and captured.err.splitlines()[0] == note, captured.err
    report = json.loads(out.read_text())
    assert report["fit"]["too_long"] == len(too_long) and report["fit"]["longest"]["tokens"] == longest[2]
    # every refused turn failed with vLLM's own words, grouped: numbers as N, one concrete example
    (group,) = report["overall"]["error_reasons"]
    assert group["kind"] == "http 400" and group["count"] == len(too_long)
    assert group["reason"].startswith("This model's maximum context length is N tokens. However, you requested N "
                                      "output tokens and your prompt contains N input tokens")
    assert group["example"].startswith(f"This model's maximum context length is {limit} tokens")
    assert f"failed: {len(too_long)} x http 400: This model's maximum context length is N tokens" in captured.out
    assert sum(1 for r in _recorded(rec) if r["answer"].get("error") == 400) == len(too_long)
    # --skip-too-long: those turns are never sent, the rest are, and nothing fails
    rec.unlink()
    rc = main(["bench", url, "--trace", str(traces["openai"]), "--max-tokens", str(max_tokens), "--skip-too-long",
               "--json", "-q"])
    report = json.loads(capsys.readouterr().out)
    sent = _recorded(rec)
    assert rc == 0 and report["overall"]["errors"] == {} and report["fit"]["skipped"] == len(too_long)
    assert len(sent) == len(counts) - len(too_long) and all(r["answer"]["prompt_tokens"] <= limit - max_tokens
                                                            for r in sent)


def test_a_server_without_tokenize_is_said_to_be_unchecked(standin, traces, capsys):
    url = standin("--tokens", "3", "--control", "--first-delay", "0", "--token-delay", "0")
    _config(url, tokenize=False)
    assert main(["bench", url, "--trace", str(traces["vllm"]), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("bench: fit: not counted before the replay (the server counts no tokens: no ")
    assert json.loads(captured.out)["fit"]["counted_by"] is None


def test_a_servers_words_are_bounded_sanitized_and_never_quote_the_prompt(standin, traces, tmp_path, capsys):
    url = standin("--tokens", "3", "--control", "--first-delay", "0", "--token-delay", "0")
    for words, shown in (("\x1b]0;pwned\x07engine \x1b[31mfailed\x1b[0m\r\x08 on step 12: input_value={prompt}",
                          "engine failed on step N ..."),
                         ("echo: {prompt}", "(the server's words quote the request: not shown)")):
        _config(url, fail_every=2, fail_message=words)
        out = tmp_path / "r.json"
        assert main(["bench", url, "--trace", str(traces["openai"]), "--out", str(out)]) == 1
        captured = capsys.readouterr()
        saved = out.read_text()
        for text in (captured.out, captured.err, saved):
            assert SECRET not in text and "\x1b" not in text and "\x07" not in text and "\x08" not in text
        (group,) = json.loads(saved)["overall"]["error_reasons"]
        assert group["kind"] == "http 500" and group["reason"] == shown, group
        assert f"x http 500: {shown}" in captured.out


def test_a_quote_of_a_multi_line_prompt_is_withheld():
    """The server's words come squashed onto one line; a prompt's newlines and indents do not hide a quote."""
    from hybrid_build.serve.bench.trace_report import WITHHELD, failure_reason

    prompt = "users:\n  alice.smith@corp.example hunter2\n\tbob.jones@corp.example   swordfish99"
    sent = [{"role": "user", "content": prompt}]
    said = "unexpected token near: users: alice.smith@corp.example hunter2 bob.jones@corp.example swordfish99"
    assert failure_reason(said, sent) == WITHHELD
    assert failure_reason("engine failed on step 12", sent) == "engine failed on step 12"


def test_an_id_with_terminal_escapes_is_printed_without_them(standin, tmp_path, capsys):
    evil = "conv\x1b[2J\x1b]0;owned\x07\r-1"
    trace = tmp_path / "evil.jsonl"
    trace.write_text(json.dumps({"id": evil, "messages": conversation(1) + [{"role": "user", "content": 7}]}) + "\n")
    assert main(["bench", "http://127.0.0.1:9/v1", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    # the escapes gone, the carriage return a space (it would have let the line overwrite itself)
    assert err == ("error: evil.jsonl: conversation conv -1 (line 1): field messages[9].content: is a number, "
                   "expected a string, a list of parts or null\n"), repr(err)
    # the same id in a line printed before a replay (the longest turn's conversation)
    trace.write_text(json.dumps({"id": evil, "messages": conversation(1)}) + "\n")
    url = standin("--tokens", "3", "--max-model-len", "30", "--first-delay", "0", "--token-delay", "0")
    assert main(["bench", url, "--trace", str(trace), "--max-tokens", "4", "--skip-too-long"]) == 0
    captured = capsys.readouterr()
    assert "(conv -1, turn" in captured.err and not any(c in captured.out + captured.err for c in "\x1b\x07\r")


# ---- every input ends -------------------------------------------------------------------------------

CLI = [sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; sys.exit(main())"]


def _cli(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    """In a child with a time limit: a reader that waited on a FIFO would block it, not this test run."""
    return subprocess.run(CLI + list(argv), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("make, says", [
    (lambda t: "/dev/zero", "zero: a character device, not a regular file"),
    (lambda t: (os.mkfifo(t / "pipe.jsonl"), t / "pipe.jsonl")[1], "pipe.jsonl: a FIFO, not a regular file"),
    (lambda t: _sparse(t / "zeros.jsonl", 40 << 20), "zeros.jsonl: line 1 is longer than 33.55 MB; not read further"),
    (lambda t: _deep(t / "deep.jsonl", '{"id": "a", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "deep.jsonl: conversation on line 1: JSON nested deeper than 100 levels; not read"),
    (lambda t: _deep(t / "deep.json", "[" + "[" * 100_000 + "]" * 100_000 + "]"),
     "deep.json: item 0: JSON nested too deep to read; not read"),
])
def test_a_trace_that_never_ends_or_nests_without_end_is_one_line_exit_2(tmp_path, make, says):
    path = make(tmp_path)
    r = _cli("bench", "http://127.0.0.1:9/v1", "--trace", str(path))
    assert r.returncode == 2 and r.stderr == f"error: {says}\n" and r.stdout == "", r.stderr


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(b'{"id": "a", "messages": "')
        f.truncate(size)  # then zeros without a line end, and no disk: a hole
    return path


def _deep(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path


def test_a_sample_is_taken_while_reading_and_holds_only_itself(tmp_path, monkeypatch):
    from hybrid_build.serve.bench import trace_formats

    path = write_openai(tmp_path / "many.jsonl", 40)
    held = []
    offer = trace_formats.Sample.offer

    def watched(self, item, nbytes=0):
        offer(self, item, nbytes)
        held.append(len(self.held))

    monkeypatch.setattr(trace_formats.Sample, "offer", watched)
    a = read_trace(path, 5, seed=1)
    assert a.total == 40 and len(a.conversations) == 5 and max(held) == 5 and len(held) == 40
    ids = [c.id for c in a.conversations]
    assert ids == sorted(ids, key=lambda i: int(i.split("-")[1]))  # in the trace's order
    assert [c.id for c in read_trace(path, 5, seed=1).conversations] == ids  # the same seed, the same sample
    assert {tuple(c.id for c in read_trace(path, 5, seed=s).conversations) for s in range(2, 8)} - {tuple(ids)}
    # without a sample size every conversation is replayed, up to MAX_HELD: more is one line
    monkeypatch.setattr(trace_formats, "MAX_HELD", 30)
    with pytest.raises(trace_formats.TraceError, match="40 conversations; more than 30 are not replayed whole"):
        read_trace(path)
