"""The one sanitizer at the print and log boundary (``core/terminal_text``): what a terminal would obey
is removed from text that came from outside, and the CLI applies it to stdout, the error line and
log lines."""
from __future__ import annotations

import io
import logging

import pytest

from hybrid_build.core.terminal_text import PrintableStream, printable


@pytest.mark.parametrize("raw, clean", [
    ("plain text, unicode é 中文", "plain text, unicode é 中文"),
    ("\x1b[31;1mred\x1b[0m", "red"),                                     # CSI: colours
    ("a\x1b[2J\x1b[Hb", "ab"),                                           # clear the screen, cursor home
    ("\x1b]0;pwned\x07title", "title"),                                  # OSC: the window title, ended by BEL
    ("\x1b]8;;https://x.example\x1b\\link\x1b]8;;\x1b\\", "link"),     # OSC 8 hyperlink, ended by ST
    ("\x1b]52;c;ZXZpbA==\x07clip", "clip"),                              # OSC 52: a clipboard write
    ("\x9b31mc1\x9b0m", "c1"),                                           # the 8-bit CSI
    ("bell\x07 back\x08space del\x7f nul\x00", "bell backspace del nul"),
    ("over\rwrite", "over\nwrite"),                                      # a line cannot overwrite itself
    ("tab\tand\nline", "tab\tand\nline"),
    ("\u202eevil\u202c", "evil"),                                        # a bidirectional override
    ("no codes [31m here", "no codes [31m here"),                        # brackets without ESC stay
])
def test_printable_removes_what_a_terminal_would_obey(raw, clean):
    assert printable(raw) == clean


def test_one_line_folds_line_ends_and_tabs():
    assert printable("a\nb\r\nc\td\x1b[1m", one_line=True) == "a b c d"


def test_the_stream_sanitizes_every_write():
    buf = io.StringIO()
    out = PrintableStream(buf)
    print("id \x1b]0;x\x07conv", file=out)
    out.write("\x1b[2J")
    assert buf.getvalue() == "id conv\n" and out.getvalue() == buf.getvalue()  # other attributes pass through


def _probe(args):
    """A command whose output carries what a server or a trace could send."""
    from hybrid_build.core.errors import HybridBuildError

    print("model \x1b[31mqwen\x1b[0m\x07")
    logging.getLogger("hybrid_build.test").warning("server said \x1b]0;owned\x07hi")
    raise HybridBuildError("bad \x1b[2Jthing\nsecond line")


def register(sub, common):  # this module as a command of the CLI (cli.COMMANDS names it below)
    sub.add_parser("probe", parents=[common]).set_defaults(handler=_probe)


def test_the_cli_sanitizes_stdout_the_error_line_and_log_lines(capsys, monkeypatch):
    from hybrid_build.pipeline import cli

    monkeypatch.setattr(cli, "COMMANDS", {"probe": __name__})
    stdout = cli.sys.stdout
    assert cli.main(["probe"]) == 1
    out, err = capsys.readouterr()
    assert out == "model qwen\n"
    assert err.splitlines() == ["WARNING hybrid_build.test: server said hi", "error: bad thing second line"]
    assert cli.sys.stdout is stdout  # the wrapper is the command's only
