"""Conversation traces that ``bench --trace`` replays, read from the three formats it takes.

- **OpenAI chat JSONL**: one conversation a line, ``{"id"?, "messages": [...], "tools"?: [...]}``,
  the messages as the chat completions API takes them (``tool_calls`` on assistant messages,
  ``tool`` messages with ``tool_call_id``).
- **vLLM's multi-turn benchmark file** (``benchmarks/multi_turn/`` in vLLM's source: what
  ``convert_sharegpt_to_openai.py`` writes and ``benchmark_serving_multi_turn.py --input-file``
  reads): one JSON array of ``{"id": str, "messages": [{"role", "content"}]}``, ids unique.
- **A Hermes agent's ``state.db``** (NousResearch/hermes-agent, ``hermes_state*.py``): SQLite,
  tables ``sessions`` (one conversation each: ``id``, ``started_at``, the system prompt inline or
  through ``system_prompts`` by ``system_prompt_hash``, ``tool_names``) and ``messages``
  (``session_id``, ``role``, ``content``, ``tool_calls`` as JSON text, ``tool_call_id``,
  ``timestamp``, ``active``). Opened read-only (``mode=ro``); a locked file or another schema is
  refused, never touched.

The format is told from the file itself (SQLite's header, a JSON array, JSON lines). Traces are
the user's data: an error names the file, the conversation id, the line or row and the field,
never a value of a message.

A trace is **streamed** (``core/bounded_read``): a regular file only (a FIFO or device is refused
before it is opened), read one conversation at a time (a JSONL line, an item of the JSON array, a
session of the state.db), each at most ``MAX_CONVERSATION_BYTES`` and nested at most
``MAX_DEPTH`` deep, every one checked, and the sample taken while reading (``Sample``: a seeded
reservoir, kept in the trace's order), so that memory holds the sample, not the trace. Without a
sample size every conversation is replayed, up to ``MAX_HELD`` of them.
"""
from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from hybrid_build.core.bounded_read import MAX_DEPTH, json_array_items, lines, open_regular, parse_json
from hybrid_build.core.byte_units import human_bytes
from hybrid_build.core.errors import CannotRun, UserError
from hybrid_build.core.limits import MAX_CONVERSATIONS

ROLES = ("system", "developer", "user", "assistant", "tool")
SQLITE_MAGIC = b"SQLite format 3\x00"
# a state.db held by a writer is waited on this long, then refused
LOCK_WAIT_S = 1.0
# a conversation id printed in a line is cut to this many characters
ID_CHARS = 64
# one conversation (a JSONL line, an item of the array) is read at most this long: a 1M-token agent
# context is ~4 MB of text
MAX_CONVERSATION_BYTES = 32 << 20
# replayed whole (no --conversations) up to this many conversations, and a sample holds at most
# MAX_HELD_BYTES of them: memory holds what is replayed, never the trace
MAX_HELD = MAX_CONVERSATIONS
MAX_HELD_BYTES = 256 << 20
# a vLLM generator config (one JSON object) is told apart by reading at most this much of it
CONFIG_BYTES = 1 << 20


class TraceError(UserError):
    """A trace that cannot be replayed: one line naming the file, the conversation and the field."""


@dataclass(frozen=True)
class Conversation:
    """One recorded conversation: its id, its messages (OpenAI chat format) and the tools offered
    (their definitions where the trace has them; ``tool_names`` the names a call may use)."""
    id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    tool_names: frozenset[str] = field(default_factory=frozenset)
    # where the names came from: "tools" (the trace's definitions), "recorded" (the calls the
    # conversation made: a state.db keeps no definitions) or "none"
    tool_names_from: str = "none"

    @property
    def assistant_turns(self) -> list[int]:
        """The indexes of the assistant messages: the turns a replay regenerates."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


@dataclass(frozen=True)
class Trace:
    """What was read of a trace file: its format, its name (never its folder), the conversations
    held (all of them, or the sample asked for) and how many the file holds (``total``)."""
    format: str
    name: str
    conversations: tuple[Conversation, ...]
    total: int = -1

    def __post_init__(self) -> None:
        if self.total < 0:
            object.__setattr__(self, "total", len(self.conversations))


class Sample:
    """``size`` of the items offered (all, when None), chosen uniformly with ``random.Random(seed)``
    while they are offered (reservoir sampling: each new item replaces a held one with probability
    size / seen), returned in the order offered: the same trace, size and seed give the same
    sample. Holds at most ``size`` items (``MAX_HELD`` without a size) and ``max_bytes`` of them;
    more is refused in one line (``what`` names the trace)."""

    def __init__(self, size: int | None, seed: int, what: str, max_bytes: int = MAX_HELD_BYTES):
        self.size, self.what, self.max_bytes = size, what, max_bytes
        self.rng = random.Random(seed)
        self.held: list[tuple[int, object, int]] = []  # (order offered, item, bytes)
        self.bytes = self.seen = 0

    def offer(self, item, nbytes: int = 0) -> None:
        i, self.seen = self.seen, self.seen + 1
        cap = MAX_HELD if self.size is None else self.size
        if len(self.held) < cap:
            self.held.append((i, item, nbytes))
            self.bytes += nbytes
        elif self.size is not None:
            j = self.rng.randrange(i + 1)
            if j >= cap:
                return
            self.bytes += nbytes - self.held[j][2]
            self.held[j] = (i, item, nbytes)
        if self.bytes > self.max_bytes:
            raise TraceError(f"{self.what}: the conversations to replay hold more than {human_bytes(self.max_bytes)}; "
                             f"replay fewer (--conversations K, a seeded sample)")

    def items(self) -> list:
        if self.size is None and self.seen > MAX_HELD:
            raise TraceError(f"{self.what}: {self.seen:,} conversations; more than {MAX_HELD:,} are not replayed "
                             f"whole: --conversations K replays a seeded sample of K")
        return [item for _, item, _ in sorted(self.held, key=lambda h: h[0])]


def take_sample(items: Iterable, size: int | None, seed: int, what: str = "trace") -> list:
    """``Sample`` over items already in memory (a synthetic trace): the same choice a file gets."""
    s = Sample(size, seed, what, max_bytes=1 << 62)
    for item in items:
        s.offer(item)
    return s.items()


def message_chars(m: dict) -> int:
    """A message's length in characters: its text and its tool calls' names and arguments."""
    content = m.get("content")
    if isinstance(content, list):
        n = sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    else:
        n = len(content or "")
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        n += len(fn.get("name") or "") + len(fn.get("arguments") or "")
    return n


def _kind(v) -> str:
    """What a JSON value is, in words (its type, never its text)."""
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def _cid(v) -> str:
    s = str(v)
    return s if len(s) <= ID_CHARS else s[:ID_CHARS] + "..."


class _Where:
    """Where a field sits, for the one line of an error."""

    def __init__(self, file: str, conversation: str, place: str = ""):
        self.file, self.conversation, self.place = file, conversation, place

    def fail(self, fld: str, problem: str) -> TraceError:
        place = f" ({self.place})" if self.place else ""
        return TraceError(f"{self.file}: conversation {self.conversation}{place}: field {fld}: {problem}")


def _check_tool_call(where: _Where, f: str, call) -> dict:
    if not isinstance(call, dict):
        raise where.fail(f, f"is {_kind(call)}, expected an object")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise where.fail(f + ".function", f"is {_kind(fn)}, expected an object with name and arguments")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise where.fail(f + ".function.name", f"is {_kind(fn.get('name'))}, expected a non-empty string")
    args = fn.get("arguments")
    if isinstance(args, dict):  # some exports store the arguments parsed; the API sends them as text
        args = json.dumps(args)
    if not isinstance(args, str):
        raise where.fail(f + ".function.arguments", f"is {_kind(args)}, expected a string of JSON")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise where.fail(f + ".id", f"is {_kind(call['id'])}, expected a string")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def check_message(where: _Where, i: int, m, label: str | None = None) -> dict:
    """One message checked and normalised to what the chat API takes (unknown keys dropped);
    its fields are named ``messages[i].x``, or ``label.x`` where given."""
    f = label if label is not None else f"messages[{i}]"
    if not isinstance(m, dict):
        raise where.fail(f, f"is {_kind(m)}, expected an object")
    role = m.get("role")
    if role not in ROLES:
        what = _kind(role) if not isinstance(role, str) else "an unknown role"
        raise where.fail(f + ".role", f"is {what}, expected one of {', '.join(ROLES)}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise where.fail(f + ".content", f"is {_kind(content)}, expected a string, a list of parts or null")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise where.fail(f"{f}.content[{j}]", "expected an object with a type")
    out: dict = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise where.fail(f + ".tool_calls", f"on a {role} message; only assistant messages call tools")
        if not isinstance(calls, list):
            raise where.fail(f + ".tool_calls", f"is {_kind(calls)}, expected a list")
        if calls:
            out["tool_calls"] = [_check_tool_call(where, f"{f}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str):
            raise where.fail(f + ".tool_call_id", f"is {_kind(tid)}, expected the id of the call it answers")
        out["tool_call_id"] = tid
    if role == "assistant" and content is None and "tool_calls" not in out:
        raise where.fail(f + ".content", "an assistant message with neither content nor tool_calls")
    if isinstance(m.get("name"), str) and role in ("tool", "user"):
        out["name"] = m["name"]
    return out


def _tool_names_of(where: _Where, tools) -> tuple[tuple[dict, ...], frozenset[str]]:
    if tools is None:
        return (), frozenset()
    if not isinstance(tools, list):
        raise where.fail("tools", f"is {_kind(tools)}, expected a list")
    names = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise where.fail(f"tools[{j}].function.name", "expected a tool definition with a function name")
        names.append(fn["name"])
    return tuple(tools), frozenset(names)


def conversation(where: _Where, cid: str, messages, tools=None) -> Conversation:
    """A conversation from its parts, every field checked."""
    if not isinstance(messages, list):
        raise where.fail("messages", f"is {_kind(messages)}, expected a list")
    if not messages:
        raise where.fail("messages", "is empty")
    msgs = tuple(check_message(where, i, m) for i, m in enumerate(messages))
    if not any(m["role"] == "assistant" for m in msgs):
        raise where.fail("messages", "has no assistant message: no turn to regenerate")
    defs, names = _tool_names_of(where, tools)
    source = "tools" if defs else "none"
    if not defs:
        names = frozenset(c["function"]["name"] for m in msgs for c in m.get("tool_calls") or [])
        source = "recorded" if names else "none"
    return Conversation(cid, msgs, defs, names, source)


# ---- the three formats ---------------------------------------------------------------------------

def _unique(conversations: list[tuple[Conversation, _Where]]) -> tuple[Conversation, ...]:
    """The held conversations, refused where two share an id (the report keys turns by it)."""
    seen = set()
    for conv, where in conversations:
        if conv.id in seen:
            raise where.fail("id", f"appears on an earlier {where.place.split()[0]} too")
        seen.add(conv.id)
    return tuple(c for c, _ in conversations)


def read_openai_jsonl(path: Path, f, sample: Sample) -> Trace:
    """One conversation a line, each read, checked and offered to the sample in turn."""
    for n, raw in lines(f, path.name, MAX_CONVERSATION_BYTES, TraceError):
        if not raw.strip():
            continue
        obj = parse_json(raw, f"{path.name}: conversation on line {n}", MAX_DEPTH, TraceError)
        cid = _cid(obj.get("id")) if isinstance(obj, dict) and isinstance(obj.get("id"), (str, int)) \
            else f"line-{n}"
        where = _Where(path.name, cid, f"line {n}")
        if not isinstance(obj, dict):
            raise where.fail("(line)", f"is {_kind(obj)}, expected an object with messages")
        sample.offer((conversation(where, cid, obj.get("messages"), obj.get("tools")), where), len(raw))
    if not sample.seen:
        raise TraceError(f"{path.name}: no conversation in the file")
    return Trace("openai-jsonl", path.name, _unique(sample.items()), sample.seen)


def read_vllm_multiturn(path: Path, f, sample: Sample) -> Trace:
    """One JSON array of conversations, read item by item."""
    for n, item in json_array_items(f, path.name, MAX_CONVERSATION_BYTES, MAX_DEPTH, error=TraceError):
        where = _Where(path.name, f"#{n}", f"item {n}")
        if not isinstance(item, dict):
            raise where.fail("(item)", f"is {_kind(item)}, expected an object with id and messages")
        if not isinstance(item.get("id"), str):
            raise where.fail("id", f"is {_kind(item.get('id'))}, expected a string")
        cid = _cid(item["id"])
        where = _Where(path.name, cid, f"item {n}")
        sample.offer((conversation(where, cid, item.get("messages"), item.get("tools")), where),
                     sum(message_chars(m) for m in item.get("messages") or [] if isinstance(m, dict)))
    if not sample.seen:
        raise TraceError(f"{path.name}: expected a JSON array of conversations (vLLM's multi-turn format)")
    return Trace("vllm-multiturn", path.name, _unique(sample.items()), sample.seen)


# the columns a Hermes state.db must have for a replay (its schema has many more)
HERMES_COLUMNS = {
    "sessions": {"id", "started_at"},
    "messages": {"id", "session_id", "role", "content", "tool_calls", "tool_call_id", "timestamp"},
}


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}


def read_hermes_state(path: Path, sample: Sample) -> Trace:
    """The sessions of a Hermes ``state.db``, oldest first, each with its active messages."""
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True, timeout=LOCK_WAIT_S)
    except sqlite3.Error as e:
        raise TraceError(f"{path.name}: cannot open as SQLite ({e})")
    try:
        return _read_hermes(path, con, sample)
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise CannotRun(f"{path.name}: locked by another process (a Hermes agent writing to it?); left "
                            f"untouched: run again when it is idle, or replay a copy")
        raise TraceError(f"{path.name}: not a Hermes state.db this bench reads ({e})")
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path.name}: not a readable SQLite database ({e})")
    finally:
        con.close()


def _json_text(text: str | None):
    """A JSON column's value (None where it is not JSON, or nested too deep)."""
    try:
        return parse_json(text, "", MAX_DEPTH, TraceError) if isinstance(text, str) else None
    except TraceError:
        return None


def _read_hermes(path: Path, con: sqlite3.Connection, sample: Sample) -> Trace:
    con.execute("BEGIN")  # one read transaction: a consistent snapshot, and a lock is seen here
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, need in HERMES_COLUMNS.items():
        if table not in tables:
            raise TraceError(f"{path.name}: not a Hermes state.db (no table {table}); another schema is not read")
        missing = sorted(need - _columns(con, table))
        if missing:
            raise TraceError(f"{path.name}: not a Hermes state.db (table {table} lacks {', '.join(missing)}); "
                             f"another schema is not read")
    scols, mcols = _columns(con, "sessions"), _columns(con, "messages")
    prompts = "system_prompts" in tables and {"hash", "prompt"} <= _columns(con, "system_prompts")
    # every text read at most one conversation's length (substr): a row cannot fill memory
    cut = MAX_CONVERSATION_BYTES + 1
    sel = ["s.id",
           f"substr(s.system_prompt, 1, {cut})" if "system_prompt" in scols else "NULL",
           f"(SELECT substr(p.prompt, 1, {cut}) FROM system_prompts p WHERE p.hash = s.system_prompt_hash)"
           if prompts and "system_prompt_hash" in scols else "NULL",
           f"substr(s.tool_names, 1, {cut})" if "tool_names" in scols else "NULL"]
    sessions = con.execute(f"SELECT {', '.join(sel)} FROM sessions s ORDER BY s.started_at, s.id")
    active = " AND active = 1" if "active" in mcols else ""
    for sid, inline_prompt, shared_prompt, tool_names in sessions:
        cid = _cid(sid)
        rows = con.execute(f"SELECT id, role, substr(content, 1, {cut}), substr(tool_calls, 1, {cut}), tool_call_id "
                           f"FROM messages WHERE session_id = ?{active} ORDER BY timestamp, id", (sid,))
        messages: list = []
        size = 0
        prompt = inline_prompt if inline_prompt is not None else shared_prompt
        own = con.execute(f"SELECT EXISTS (SELECT 1 FROM messages WHERE session_id = ? AND role = 'system'{active})",
                          (sid,)).fetchone()[0]
        if isinstance(prompt, str) and prompt and not own:
            messages.append({"role": "system", "content": prompt})
            size += len(prompt)
        for row_id, role, content, calls, call_id in rows:
            where = _Where(path.name, cid, f"messages row {row_id}")
            m: dict = {"role": role, "content": content}
            size += len(content) if isinstance(content, str) else 0
            if calls is not None and calls != "":
                size += len(calls) if isinstance(calls, str) else 0
                m["tool_calls"] = _json_text(calls)
                if m["tool_calls"] is None:
                    raise where.fail("messages.tool_calls", "not JSON")
            if call_id is not None:
                m["tool_call_id"] = call_id
            if size > MAX_CONVERSATION_BYTES:
                raise where.fail("messages", f"the session is longer than {human_bytes(MAX_CONVERSATION_BYTES)}; "
                                             "not read further")
            messages.append(check_message(where, len(messages), m, label="messages"))
        if not any(m["role"] == "assistant" for m in messages):
            continue  # a session that never answered (just opened, or only a system prompt)
        parsed = _json_text(tool_names) if tool_names else None
        names = frozenset(parsed) if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed) \
            else frozenset()
        conv = conversation(_Where(path.name, cid), cid, messages)
        if names:
            conv = Conversation(conv.id, conv.messages, (), names, "state.db tool_names")
        sample.offer(conv, size)
    held = sample.items()
    if not held:
        raise TraceError(f"{path.name}: no session with an assistant message")
    return Trace("hermes-state-db", path.name, tuple(held), sample.seen)


def _first_byte(f) -> bytes:
    """The first byte that is not white space (the file's position back at its start)."""
    while chunk := f.read(1 << 16):
        if chunk.strip():
            first = chunk.lstrip()[:1]
            f.seek(0)
            return first
    f.seek(0)
    return b""


def read_trace(path: Path, sample: int | None = None, seed: int = 0) -> Trace:
    """A trace file in any of the three formats, told from its first bytes, streamed: the ``sample``
    conversations (all when None; ``Sample``) with ``seed``, every conversation of the file checked."""
    taken = Sample(sample, seed, path.name)
    with open_regular(path, path.name, TraceError) as f:
        head = f.read(len(SQLITE_MAGIC))
        f.seek(0)
        if head != SQLITE_MAGIC:
            start = _first_byte(f)
            if start == b"[":
                return read_vllm_multiturn(path, f, taken)
            if start == b"{":
                head = f.read(4096)
                f.seek(0)
                if b'"filetype"' in head:  # a vLLM generation config (one object), refused by name
                    obj = _json_text(f.read(CONFIG_BYTES).decode("utf-8", "replace"))
                    f.seek(0)
                    if isinstance(obj, dict) and "filetype" in obj:
                        raise TraceError(f"{path.name}: vLLM's synthetic-conversation config, not conversations "
                                         f"(give a file of conversations, or --trace agent-synthetic)")
                return read_openai_jsonl(path, f, taken)
            raise TraceError(f"{path.name}: not a trace (expected OpenAI chat JSONL, vLLM's multi-turn JSON array "
                             f"or a Hermes state.db)")
    return read_hermes_state(path, taken)
