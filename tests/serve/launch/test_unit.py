"""`serve --print-unit` writes a systemd unit for the user's own command line: restarted on
failure (serve's exit 1 on an engine fault), not on bad input (2), after long enough for memory to
come back, stopped through serve; a key on the command line is refused (it would be in the unit)."""
from __future__ import annotations

import shlex

import pytest

from hybrid_build.pipeline.cli import main


def _unit(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["serve", *argv, "--print-unit"])
    return rc, capsys.readouterr().out


def _refused(capsys, *argv: str) -> str:
    """The one line a unit that cannot be written as meant is refused with (exit 2, nothing printed)."""
    rc = main(["serve", *argv, "--print-unit"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_the_unit_runs_this_command_line_and_restarts_on_failure(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["out dir/", "--profile", "dense", "--restart", "2", "--log", "serve 100%.log", "--stop-grace", "20"]
    rc, unit = _unit(capsys, *argv)
    assert rc == 0
    fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    words = shlex.split(fields["ExecStart"].replace("%%", "%"))
    assert words[words.index("serve"):] == ["serve", *argv], words  # --print-unit itself left out
    assert fields["Restart"] == "on-failure" and fields["RestartPreventExitStatus"] == "2"
    assert int(fields["RestartSec"]) >= 60  # a GB10's memory comes back over ~60 s
    assert fields["KillMode"] == "mixed" and int(fields["TimeoutStopSec"]) > 20  # serve's own grace fits in it
    assert fields["WorkingDirectory"] == str(tmp_path)  # relative paths as typed


def test_a_key_on_the_command_line_is_not_written_into_the_unit(capsys):
    rc, out = _unit(capsys, "out/", "--api-key", "sekret-123")
    assert rc == 2 and "sekret-123" not in out + capsys.readouterr().err


def _exec_words(line: str) -> list[str]:
    """ExecStart's argv as systemd reads the words this unit writes (systemd.syntax(7),
    systemd.service(7)): specifiers first (``%%`` -> ``%``), then words split on whitespace with
    double quotes and C escapes removed, then ``$$`` -> ``$`` in each word."""
    line = line.replace("%%", "%")
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        assert line[i] == '"', f"an unquoted word at {i}: {line[i:i + 20]!r}"
        i += 1
        word = []
        while line[i] != '"':
            if line[i] == "\\":
                assert line[i + 1] in '\\"', f"an escape this unit does not write: {line[i:i + 2]!r}"
                i += 1
            word.append(line[i])
            i += 1
        i += 1
        words.append("".join(word).replace("$$", "$"))
    return words


HOSTILE = ["out dir/ %h $HOME ${PATH} \\n 'single' \"double\" ; back\\slash", "--profile", "dense", "--log",
           "100% $USER; \\\\ \"q\".log", "--restart", "2"]


def test_every_argument_comes_back_from_the_unit_as_typed(capsys, tmp_path, monkeypatch):
    """Specifiers, variables, quotes, backslashes, semicolons and spaces in the arguments and the
    working folder: each ExecStart word reads back as typed, and systemd-analyze (where it exists)
    accepts the unit without a word of warning."""
    import shutil
    import subprocess

    cwd = tmp_path / "work 100% $x"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc, unit = _unit(capsys, *HOSTILE)
    assert rc == 0
    fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    words = _exec_words(fields["ExecStart"])
    assert words[words.index("serve"):] == ["serve", *HOSTILE], words
    assert fields["WorkingDirectory"].replace("%%", "%") == str(cwd)
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here: the unit was checked by the rules above only")
    path = tmp_path / "hybrid-build-serve.service"
    path.write_text(unit)
    r = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@pytest.mark.parametrize("bad", ["out/\nExecStartPre=/bin/touch /tmp/pwned", "out/\rx", "out/\x1b[31m", "out/\x85"])
@pytest.mark.parametrize("where", ["artifact", "--log"])
def test_a_control_character_in_any_argument_is_refused_in_one_line(capsys, bad, where):
    argv = [bad, "--profile", "dense"] if where == "artifact" else ["out/", "--log", bad]
    assert "holds a control character" in _refused(capsys, *argv)


def test_a_control_character_in_the_working_folder_is_refused(capsys, tmp_path, monkeypatch):
    cwd = tmp_path / "a\nExecStartPre=x"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert "the working folder" in _refused(capsys, "out/")
