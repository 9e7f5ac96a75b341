"""One exit code per outcome across every command (0 passed, 1 a check failed, 2 bad input, 3 could
not run here), and `--json` prints one JSON object on every path, failures included.

Every command of the CLI's registry (``COMMANDS``) is walked through a bad input of its own and an
unknown option: exit 2, one line on stderr, no traceback, nothing written. Those that talk to a
server or to the Hub are walked to one that is not there: exit 3. A command added to the registry
without a row here fails ``test_every_command_has_a_bad_input``.
"""
from __future__ import annotations

import json
import socket

import pytest

from hybrid_build.pipeline.cli import COMMANDS, build_parser, main

# a bad input each command refuses before it does anything ({tmp}: the test's empty folder)
BAD_INPUT = {
    "inspect": ["./no/such/checkpoint"],
    "demo-checkpoint": ["{tmp}/file/out"],
    "run": ["./no/such/checkpoint", "-o", "{tmp}/out"],
    "status": ["{tmp}/no-such-artifact"],
    "verify-artifact": ["{tmp}/no-such-artifact"],
    "validate": ["{tmp}/no-such-artifact"],
    "verify": ["not-a-url", "--artifact", "{tmp}"],
    "eval": ["--limit", "-1", "--out", "{tmp}/eval.json"],
    "plan": ["./no/such/checkpoint"],
    "publish": ["{tmp}/no-such-artifact", "--repo-id", "org/name", "--dry-run"],
    "serve": ["{tmp}/no-such-artifact", "--dry-run"],
    "bench": ["ftp://example.invalid/v1"],
}

# what talks to a server or the Hub, pointed at one that is not there ({url}: a refused port; the
# tests run with HF_HUB_OFFLINE=1 and an empty Hub cache)
NOT_THERE = {
    "verify": ["{url}", "--artifact", "{tmp}"],
    "eval": ["--source-url", "{url}", "--hybrid-url", "{url}", "--out", "{tmp}/eval.json"],
    "bench": ["{url}", "--runs", "1"],
    "inspect": ["some-org/some-model"],
    "plan": ["some-org/some-model"],
    "run": ["some-org/some-model", "-o", "{tmp}/out"],
}


@pytest.fixture
def refused_url():
    """An http URL whose port refuses connections: bound here, never listening, so nothing else takes it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _has_json(command: str) -> bool:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return any(a.dest == "json" for a in sub._actions)


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err


def _one_error_line(err: str) -> None:
    """The error is one line, the last; a command that started may have said what it was doing before
    (eval's first line comes at once, before it reaches a server)."""
    lines = err.splitlines()
    assert [ln for ln in lines if ln.startswith("error: ")] == lines[-1:], err
    assert "Traceback" not in err


def _fill(args, **values) -> list[str]:
    return [a.format(**values) for a in args]


def test_every_command_has_a_bad_input():
    assert set(BAD_INPUT) == set(COMMANDS)
    assert set(NOT_THERE) <= set(COMMANDS)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_input_is_one_line_and_exit_2(command, tmp_path, capsys):
    (tmp_path / "file").write_text("a file where a folder should be\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [command, *_fill(BAD_INPUT[command], tmp=tmp_path)]
    code, out, err = _run(argv, capsys)
    assert code == 2, (argv, err)
    _one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused command wrote something"
    if _has_json(command):
        code, out, err = _run(argv + ["--json"], capsys)
        assert code == 2
        _one_line(err)
        data = json.loads(out)
        assert data["outcome"] == "bad input" and data["exit_code"] == 2 and data["error"] in err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_option_is_one_line_and_exit_2(command, capsys):
    code, out, err = _run([command, "--no-such-option"], capsys)
    assert code == 2
    _one_line(err)
    assert out == ""
    code, out, err = _run([command, "--no-such-option", "--json"], capsys)
    assert code == 2 and json.loads(out)["outcome"] == "bad input"


@pytest.mark.parametrize("command", list(NOT_THERE))
def test_no_server_or_no_hub_is_exit_3_with_a_json_object(command, tmp_path, refused_url, capsys):
    argv = [command, *_fill(NOT_THERE[command], tmp=tmp_path, url=refused_url)]
    code, out, err = _run(argv, capsys)
    assert code == 3, (argv, err)
    _one_error_line(err)
    code, out, err = _run(argv + ["--json"], capsys)
    assert code == 3
    _one_line(err)  # --json: the error line alone on stderr
    data = json.loads(out)
    assert data["outcome"] == "could not run" and data["exit_code"] == 3
    assert list(tmp_path.iterdir()) == [], "a command that could not run wrote something"
