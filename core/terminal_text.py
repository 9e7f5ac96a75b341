"""Text from outside (a trace's conversation id, a server's error message, an artifact's metadata)
printed without what a terminal would obey: ``printable(text)`` removes escape sequences (CSI: colours,
cursor moves, screen clears; OSC: window titles, hyperlinks, clipboard writes; the two-character
escapes), every other control character but the line feed and the tab (backspace, bell, the C1
range...), and the bidirectional overrides that make a line read other than it is stored. A
carriage return, which would let a line overwrite what came before it, becomes a line feed.

The CLI applies it where text leaves the process: every write to stdout (``PrintableStream``,
installed for the length of a command), the one error line, and every log line. JSON output needs
nothing: ``json.dumps`` writes control characters as ``\\u`` escapes.
"""
from __future__ import annotations

import re
from typing import TextIO

# ESC then a CSI, an OSC (to BEL or ST) or a two-character escape; a CSI's 8-bit form too
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]?|\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?|[ -~]?)"
                      r"|\x9b[0-?]*[ -/]*[@-~]?|\x9d[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?")
# C0 but LF and TAB, DEL, C1, and the bidirectional embeddings, overrides and isolates
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, one_line: bool = False) -> str:
    """``text`` without terminal escape sequences and control characters (line feeds and tabs kept; a
    carriage return becomes a line feed). ``one_line``: line feeds and tabs become spaces too."""
    if text.isprintable():
        return text
    text = _CONTROLS.sub("", _ESCAPES.sub("", text).replace("\r\n", "\n").replace("\r", "\n"))
    return text.replace("\n", " ").replace("\t", " ") if one_line else text


class PrintableStream:
    """A text stream whose writes pass through ``printable`` (stdout, for the length of a command)."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
