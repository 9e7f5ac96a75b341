"""What `bench` measures and by which rules, readable without the HTTP client: the workload bank (one
chat request per kind of text), the most streams at once, and the thresholds of a verdict and its
warnings. `bench --help` states them; ``bench`` runs them."""
from __future__ import annotations

import json
from dataclasses import dataclass

from hybrid_build.core.limits import MAX_STREAMS

_AGENT_SYSTEM = ("You are a coding agent working in a Python repository. Act only through the tools; "
                 "answer every turn with exactly one tool call.")
_AGENT_TOOLS = (
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command in the repository root and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Return the text of a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file of the repository with the given text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                        "glob": {"type": "string", "description": "file filter"}},
                       "required": ["pattern"]}}},
)
_STATS_PY = '''"""Small descriptive statistics."""


def mean(values):
    """Arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


def median(values):
    """Middle value of a non-empty sequence (mean of the two middle values for an even count)."""
    n = len(values)
    mid = n // 2
    if n % 2:
        return values[mid]
    return (values[mid - 1] + values[mid]) / 2


def spread(values):
    """Largest minus smallest value."""
    return max(values) - min(values)
'''
_PYTEST_OUT = ("F                                                                        [100%]\n"
               "FAILED tests/test_stats.py::test_median - assert 1 == 2\n"
               " +  where 1 = median([3, 1, 2])\n1 failed in 0.03s")


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


@dataclass(frozen=True)
class Workload:
    """One chat request of the bank: what the model is asked, and what kind of text it answers with."""
    name: str
    about: str
    messages: tuple
    tools: tuple = ()


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("prose", "an essay: open-ended English, the lowest acceptance", (
        {"role": "user", "content": "Write an essay of about 600 words on the history of tea: where it was first "
                                    "drunk, how it travelled along the trade routes to Japan, India, Persia and "
                                    "Europe, and how it changed the societies that took it up. Write flowing "
                                    "paragraphs, with no headings and no lists."},)),
    Workload("code", "a Python module with tests", (
        {"role": "user", "content": "Write a complete Python module lru_cache.py: a thread-safe LRU cache class "
                                    "with get, put, delete, __len__ and __contains__, type hints and docstrings, "
                                    "followed by unittest test cases for eviction order, updates and concurrent "
                                    "use. Output only the code."},)),
    Workload("counting", "1, 2, 3... up to 1000: the most predictable text, the highest acceptance", (
        {"role": "user", "content": "Count from 1 to 1000 in digits, separated by a comma and a space, with "
                                    "nothing before or after the numbers."},)),
    Workload("agent", "the next turn of a coding agent: a tool call whose JSON carries a whole file", (
        {"role": "system", "content": _AGENT_SYSTEM},
        {"role": "user", "content": "tests/test_stats.py::test_median fails. Find the bug in the package and fix "
                                    "it; keep the other functions as they are."},
        _call("call_1", "run_shell", {"command": "python -m pytest -q tests/test_stats.py::test_median"}),
        {"role": "tool", "tool_call_id": "call_1", "content": _PYTEST_OUT},
        _call("call_2", "read_file", {"path": "stats.py"}),
        {"role": "tool", "tool_call_id": "call_2", "content": _STATS_PY},
    ), _AGENT_TOOLS),
)}


# the flag: a side accepting less than LOW_ACCEPTANCE_FRACTION of the other side's tokens per draft,
# and at least LOW_ACCEPTANCE_MIN_GAP fewer (two near-useless drafters do not flag each other),
# measured over at least MIN_DRAFTS drafts on each side
LOW_ACCEPTANCE_FRACTION = 0.5
LOW_ACCEPTANCE_MIN_GAP = 0.25
MIN_DRAFTS = 10
# two sides whose median answer lengths differ by more than this factor get a note
LENGTH_MISMATCH = 1.25
# one server alone: a drafter that lands fewer than this many tokens per draft earns a warning
USELESS_DRAFTER = 0.1
# a verdict needs this many measured runs on each side
MIN_RUNS_FOR_VERDICT = 3
# concurrent streams: a stream that decoded less than this share of its window while all streams
# were decoding earns a warning (its tok/s was partly measured with fewer streams running)
LOW_OVERLAP = 0.5
# more streams than the sequences vLLM batches at most would queue, not overlap (core/limits)
MAX_CONCURRENCY = MAX_STREAMS
