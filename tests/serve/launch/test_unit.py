"""`serve --print-unit` writes a systemd unit for the user's own command line: restarted on
failure (serve's exit 1 on an engine fault), not on bad input (2), after long enough for memory to
come back, stopped through serve; a key on the command line is refused (it would be in the unit)."""
from __future__ import annotations

import shlex

from hybrid_build.pipeline.cli import main


def _unit(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["serve", *argv, "--print-unit"])
    return rc, capsys.readouterr().out


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
