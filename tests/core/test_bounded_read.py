"""``core/bounded_read``: every file read from outside ends. Regular files only (a FIFO is refused
before it is opened: a test that regressed would hang on it, so those run in a child with a time
limit), size caps, a nesting limit measured before the parser recurses, streamed lines and items."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from hybrid_build.core import bounded_read as br
from hybrid_build.core.errors import ArtifactError, UserError


def test_the_depth_is_measured_exactly_and_strings_do_not_count():
    assert not br.depth_over("[" * 100 + "]" * 100) and br.depth_over("[" * 101 + "]" * 101)
    assert not br.depth_over(json.dumps({"a": "[" * 500 + "{" * 500}))  # brackets inside a string
    assert not br.depth_over(json.dumps({"a": "\\\"[[[[" * 200}))  # escaped quotes inside a string
    nested: object = 1
    for i in range(100):
        nested = [nested] if i % 2 else {"k": nested}
    assert not br.depth_over(json.dumps(nested)) and br.depth_over(json.dumps([nested]))
    assert not br.depth_over(json.dumps([[1, [2]]] * 5000))  # wide, shallow: many brackets, depth 3


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "x.json: JSON nested deeper than 100 levels; not read"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "x.json: JSON nested deeper than 100 levels; not read"),
    ("[1, 2", "x.json: not JSON (Expecting ',' delimiter at line 1 column 6)"),
])
def test_parse_json_is_one_line(text, says):
    with pytest.raises(UserError) as e:
        br.parse_json(text, "x.json")
    assert str(e.value) == says


def test_limits_are_exit_2_and_parse_errors_the_callers_type(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ArtifactError):
        br.read_json(bad, "bad.json", error=ArtifactError)
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"0," * 600 + b"0]")
    with pytest.raises(br.InputRefused, match="larger than 1.00 kB, the most read of such a file"):
        br.read_json(big, "big.json", cap=1000, error=ArtifactError)  # a limit stays InputRefused (exit 2)
    assert br.InputRefused.exit_code == 2


def test_yaml_nested_without_end_is_one_line():
    with pytest.raises(br.InputRefused, match="YAML nested"):
        br.parse_yaml("a: " + "[" * 5000 + "]" * 5000, "r.yaml")
    deep = "".join(f"{'  ' * i}k{i}:\n" for i in range(1200)) + "  " * 1200 + "v: 1\n"  # block nesting
    with pytest.raises(br.InputRefused, match="YAML nested"):
        br.parse_yaml(deep, "r.yaml")
    assert br.parse_yaml("a: [1, {b: 2}]", "r.yaml") == {"a": [1, {"b": 2}]}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_array_items_stream_across_any_chunk_boundary(chunk):
    items = [{"id": str(i), "text": "é" * i, "n": 10 ** i, "nested": [[i]]} for i in range(12)]
    data = json.dumps(items, indent=1).encode()
    got = [item for _, item in br.json_array_items(io.BytesIO(data), "a.json", 1 << 20, chunk=chunk)]
    assert got == items


@pytest.mark.parametrize("data, says", [
    (b"[1, 2", "a.json: cut off after item 1"),
    (b"[1 2]", "a.json: item 1: expected ',' or ']' between items"),
    (b"[1] x", "a.json: text after the JSON array"),
    (b'["' + b"x" * 5000 + b'"]', "a.json: item 0 is longer than 1.00 kB; not read further"),
    (b"[" + b"[" * 150 + b"]" * 150 + b"]", "a.json: item 0: JSON nested deeper than 100 levels; not read"),
])
def test_array_items_refuse_in_one_line(data, says):
    with pytest.raises(UserError) as e:
        list(br.json_array_items(io.BytesIO(data), "a.json", 1000, chunk=3))
    assert str(e.value) == says


def test_lines_are_bounded_and_a_line_without_end_is_refused_there():
    f = io.BytesIO(b"one\r\ntwo\n" + b"x" * 50 + b"\nlast")
    with pytest.raises(br.InputRefused, match="t.jsonl: line 3 is longer than 40 B"):
        for _ in br.lines(f, "t.jsonl", 40):
            pass
    assert list(br.lines(io.BytesIO(b"a\nb"), "t", 10)) == [(1, b"a"), (2, b"b")]


CHILD = """
import sys
from hybrid_build.core import bounded_read as br
try:
    br.read_text(sys.argv[1], sys.argv[2])
except br.InputRefused as e:
    print(e)
"""


@pytest.mark.parametrize("make", ["fifo", "/dev/zero", "/dev/null", "socket"])
def test_only_regular_files_are_read_and_a_fifo_is_never_opened(tmp_path, make):
    import socket

    if make == "fifo":
        path = tmp_path / "p"
        os.mkfifo(path)
        kind = "a FIFO"
    elif make == "socket":
        path = tmp_path / "s"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        kind = "a socket"
    else:
        path, kind = make, "a character device"
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), "input"], capture_output=True, text=True, timeout=60)
    assert r.stdout == f"input: {kind}, not a regular file\n", r.stderr
