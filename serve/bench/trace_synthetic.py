"""``--trace agent-synthetic``: coding-agent conversations made from a seed, with stated statistics.

Each conversation is what an agent's session looks like to the server: a system prompt and tool
definitions shared by every conversation (the agent's), a task from the user, then assistant turns
of which a share ``tool_share`` are tool calls (exactly, over all conversations; the public recipe's
real traces: 73%), each call answered by a tool result, the others text answers followed by the
user's next message. The context grows from about ``start`` tokens (system prompt, tools, task) to
about ``end`` at the last turn: the tool results and user messages carry the growth, spread over the
turns with random weights. Assistant turns are ``call_tokens`` (a call's JSON) or ``answer_tokens``
long (uniform between the two bounds). Words are drawn from a list of common short English words,
one token each for most tokenizers (the report's prompt tokens are the server's count). Everything
comes from ``random.Random(seed)``: the same seed and parameters give the same bytes.

Parameters are given after the name: ``agent-synthetic:conversations=4,turns=12,end=20000``.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields

from hybrid_build.core.errors import UserError

from .trace_formats import Conversation, Trace

NAME = "agent-synthetic"

_WORDS = ("the of and to in is that it for on with as was at by this be are from or have an they which one "
          "you had not but what all were when we there can file line test run code value error call return "
          "list name path data type make time each use new see more after first may way then now only over "
          "also back just any most well very where through much before right too good same own such long "
          "little work state read write open close check set get add find change keep need show turn move").split()

_TOOLS = (
    ("terminal", {"command": "string", "timeout": "integer"}),
    ("read_file", {"path": "string", "offset": "integer", "limit": "integer"}),
    ("write_file", {"path": "string", "content": "string"}),
    ("patch", {"path": "string", "old_string": "string", "new_string": "string"}),
    ("search_files", {"pattern": "string", "path": "string"}),
    ("web_search", {"query": "string"}),
    ("browser_navigate", {"url": "string"}),
    ("todo", {"items": "string"}),
)


@dataclass(frozen=True)
class SyntheticParams:
    """The generator's statistics (token counts are words, ~1 token each)."""
    conversations: int = 10
    turns: int = 24            # assistant turns per conversation
    tool_share: float = 0.73   # share of assistant turns that are tool calls
    start: int = 6000          # context tokens before the first assistant turn
    end: int = 100000          # context tokens before the last assistant turn
    call_tokens: tuple[int, int] = (40, 300)
    answer_tokens: tuple[int, int] = (80, 600)
    seed: int = 0

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def parse_spec(spec: str, seed: int) -> SyntheticParams:
    """``agent-synthetic[:k=v,...]`` into parameters; ranges as ``lo-hi``."""
    name, _, rest = spec.partition(":")
    if name != NAME:
        raise UserError(f"unknown synthetic trace {name!r} (known: {NAME})")
    kinds = {f.name: f.type for f in fields(SyntheticParams)}
    values: dict = {"seed": seed}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, text = item.partition("=")
        if not eq or key not in kinds or key == "seed":
            raise UserError(f"{NAME}: unknown parameter {key!r} (known: "
                            f"{', '.join(k for k in kinds if k != 'seed')}; the seed is --seed)")
        try:
            if "tuple" in str(kinds[key]):
                lo, _, hi = text.partition("-")
                values[key] = (int(lo), int(hi or lo))
            elif "float" in str(kinds[key]):
                values[key] = float(text)
            else:
                values[key] = int(text)
        except ValueError:
            raise UserError(f"{NAME}: {key}={text}: not a number")
    p = SyntheticParams(**values)
    if p.conversations < 1 or p.turns < 1 or not 0 <= p.tool_share <= 1 or p.start < 50 or p.end < p.start:
        raise UserError(f"{NAME}: need conversations >= 1, turns >= 1, 0 <= tool_share <= 1, start >= 50, "
                        f"end >= start")
    if any(lo < 1 or hi < lo for lo, hi in (p.call_tokens, p.answer_tokens)):
        raise UserError(f"{NAME}: token ranges lo-hi with 1 <= lo <= hi")
    return p


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(n, 1)))


def _tools() -> list[dict]:
    return [{"type": "function", "function": {
        "name": name, "description": f"The agent's {name.replace('_', ' ')} tool.",
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in params.items()},
                       "required": [next(iter(params))]}}} for name, params in _TOOLS]


def _tools_tokens(tools: list[dict]) -> int:
    return sum(len(json.dumps(t).split()) for t in tools)


def _call(rng: random.Random, cid: str, turn: int, n: int) -> dict:
    name, params = _TOOLS[rng.randrange(len(_TOOLS))]
    args: dict = {}
    keys = list(params)
    for k in keys:
        args[k] = rng.randrange(1, 400) if params[k] == "integer" else _text(rng, max(1, n // len(keys)))
    return {"id": f"call_{cid}_{turn}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def generate(p: SyntheticParams) -> Trace:
    """The conversations of these parameters."""
    rng = random.Random(p.seed)
    tools = _tools()
    system_words = max(p.start * 2 // 3 - _tools_tokens(tools), 20)
    system = "You are a coding agent. " + _text(random.Random(f"{p.seed}-system"), system_words)
    # exactly round(tool_share x all turns) calls, placed at random over all conversations' turns
    total = p.conversations * p.turns
    pool = [True] * round(p.tool_share * total) + [False] * (total - round(p.tool_share * total))
    rng.shuffle(pool)
    convs = []
    for c in range(p.conversations):
        cid = f"synthetic-{c:03d}"
        task_words = max(p.start - system_words - _tools_tokens(tools), 10)
        messages: list[dict] = [{"role": "system", "content": system},
                                {"role": "user", "content": f"Task {c}. " + _text(rng, task_words)}]
        kinds = pool[c * p.turns:(c + 1) * p.turns]
        lengths = [rng.randint(*(p.call_tokens if k else p.answer_tokens)) for k in kinds]
        # the growth left once the assistant turns are counted, spread over the turns' inputs
        grow = max(p.end - p.start - sum(lengths[:-1]), 0)
        weights = [rng.random() + 0.2 for _ in range(max(p.turns - 1, 1))]
        shares = [round(grow * w / sum(weights)) for w in weights]
        for t in range(p.turns):
            if kinds[t]:
                call = _call(rng, f"{c}", t, lengths[t])
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if t < p.turns - 1:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": _text(rng, max(shares[t], 1))})
            else:
                messages.append({"role": "assistant", "content": _text(rng, lengths[t])})
                if t < p.turns - 1:
                    messages.append({"role": "user", "content": _text(rng, max(shares[t], 1))})
        convs.append(Conversation(cid, tuple(messages), tuple(tools),
                                  frozenset(t["function"]["name"] for t in tools), "tools"))
    return Trace(NAME, NAME, tuple(convs))


def stated(trace: Trace, p: SyntheticParams) -> dict:
    """The parameters and what the generated trace measures (tool-call share, context at the
    first and last turn, in words), for the report."""
    turns = [m for c in trace.conversations for m in c.messages if m["role"] == "assistant"]
    calls = sum(1 for m in turns if m.get("tool_calls"))
    first, last = [], []
    for c in trace.conversations:
        idx = c.assistant_turns
        words = [len(json.dumps(m).split()) for m in c.messages]
        tools = _tools_tokens(list(c.tools))
        first.append(sum(words[:idx[0]]) + tools)
        last.append(sum(words[:idx[-1]]) + tools)
    return {"parameters": p.to_json(), "measured": {
        "assistant_turns": len(turns), "tool_call_share": calls / len(turns) if turns else None,
        "context_words_first_turn": [min(first), max(first)], "context_words_last_turn": [min(last), max(last)]}}
