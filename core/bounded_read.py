"""Every file read from outside ends: a trace, a recipe, a signature, a report, a config, any JSON or
YAML a user or an artifact supplies goes through here.

- **Regular files only.** A FIFO, device or socket is refused before it is opened for reading (a
  FIFO would wait for a writer, ``/dev/zero`` never ends); the file is opened non-blocking and
  checked again on its descriptor, so one swapped in meanwhile cannot hang the read either.
- **A size cap.** A whole file is read at most ``cap`` bytes; a larger one is refused, never read
  further. A file read line by line (``lines``) or item by item (``json_array_items``) is streamed:
  one line or item at a time, each at most its own cap, so a line without an end is refused there.
- **JSON nested at most ``MAX_DEPTH`` levels.** The depth is measured before the parser sees the text
  (``check_depth``), and a ``RecursionError`` is caught as well: deep nesting is one line, never a
  traceback. YAML is checked on the parsed value (its parser recurses in Python).

Every refusal is one line naming what was read (``what``, which the caller words: a file's name, a
field). What passes a limit (not a regular file, over a cap, nested too deep, a line without end) is
an ``InputRefused``, a ``UserError``: exit 2. What cannot be read or parsed (missing, unreadable, not
UTF-8, not JSON) is the caller's ``error`` type, ``InputRefused`` unless it names another (an
artifact's own file that does not parse is an ``ArtifactError``: rebuild it).
"""
from __future__ import annotations

import codecs
import errno
import itertools
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .byte_units import human_bytes
from .errors import UserError

MAX_DEPTH = 100           # JSON and YAML nesting: far above what a config, a report or a tool schema uses
JSON_CAP = 64 << 20       # a whole JSON file (a safetensors index of a large model is a few MB)
SMALL_JSON = 1 << 20      # a marker, a record, a signature: a few KB
TEXT_CAP = 4 << 20        # a recipe, a nodes file, a texts file
SECRET_CAP = 64 << 10     # a key or token file

_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))
# a JSON string (escapes included), removed before brackets are counted
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SPACE = re.compile(r"\s*")


class InputRefused(UserError):
    """A file or value from outside that is not what it should be: one line, exit 2."""


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    return next((word for test, word in _SPECIAL if test(mode)), "not a regular file")


def _os_line(what: str, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return f"{what}: a loop of symbolic links"
    if e.errno == errno.ENOTDIR:
        return f"{what}: a part of the path is a file, not a folder"
    if e.errno == errno.ENOENT:
        return f"{what}: no such file"
    return f"{what}: {e.strerror or e}"


def open_regular(path: str | os.PathLike, what: str, error: type[Exception] = InputRefused) -> IO[bytes]:
    """``path`` opened for binary reading, refused in one line unless it is a regular file (symbolic
    links followed). The mode is read before the open, and again on the open descriptor."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        raise error(_os_line(what, e)) from None
    if not stat.S_ISREG(mode):
        raise InputRefused(f"{what}: {kind_of(mode)}, not a regular file")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as e:
        raise error(_os_line(what, e)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputRefused(f"{what}: {kind_of(mode)}, not a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, what: str, cap: int = JSON_CAP,
               error: type[Exception] = InputRefused) -> bytes:
    """A regular file's bytes, at most ``cap``: a larger file is refused after ``cap + 1`` bytes."""
    with open_regular(path, what, error) as f:
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise error(_os_line(what, e)) from None
    if len(data) > cap:
        raise InputRefused(f"{what}: larger than {human_bytes(cap)}, the most read of such a file")
    return data


def decode_text(data: bytes, what: str, error: type[Exception] = InputRefused, nul: bool = False) -> str:
    """UTF-8 text (a BOM dropped); bytes that are not UTF-8, or a NUL byte unless ``nul``, refused."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what}: not a UTF-8 text file (byte {e.start} is 0x{data[e.start]:02x})") from None
    if not nul and "\x00" in text:
        raise error(f"{what}: not a text file (it holds NUL bytes at byte {text.index(chr(0))})")
    return text


def read_text(path: str | os.PathLike, what: str, cap: int = TEXT_CAP, error: type[Exception] = InputRefused) -> str:
    """A regular file's UTF-8 text, at most ``cap`` bytes."""
    return decode_text(read_bytes(path, what, cap, error), what, error)


def depth_over(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON ``text`` nests arrays and objects deeper than ``limit``: its strings removed,
    then its brackets only, each pass dropping the innermost pairs (each pass is a C-speed
    ``str.replace``; at most ``limit`` of them). Brackets that do not pair are left to the parser."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).replace("{", "[").replace("}", "]")
    for _ in range(limit):
        shorter = brackets.replace("[]", "")
        if len(shorter) == len(brackets):
            return False
        brackets = shorter
    return "[]" in brackets


def check_depth(text: str, what: str, limit: int = MAX_DEPTH, error: type[Exception] = InputRefused) -> None:
    if depth_over(text, limit):
        raise InputRefused(f"{what}: JSON nested deeper than {limit} levels; not read")


def parse_json(data: bytes | str, what: str, limit: int = MAX_DEPTH, error: type[Exception] = InputRefused) -> Any:
    """JSON from bytes (UTF-8) or text, nested at most ``limit`` deep; one line for anything else."""
    text = decode_text(data, what, error, nul=True) if isinstance(data, (bytes, bytearray)) else data
    check_depth(text, what, limit, error)
    try:
        return json.loads(text)
    except RecursionError:
        raise InputRefused(f"{what}: JSON nested too deep to read; not read") from None
    except json.JSONDecodeError as e:
        raise error(f"{what}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def read_json(path: str | os.PathLike, what: str, cap: int = JSON_CAP, limit: int = MAX_DEPTH,
              error: type[Exception] = InputRefused) -> Any:
    """A regular file's JSON: at most ``cap`` bytes, nested at most ``limit`` deep."""
    return parse_json(read_bytes(path, what, cap, error), what, limit, error)


def value_depth(value: Any) -> int:
    """How deep a parsed value nests lists and dicts (a walk without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, (list, tuple)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v if isinstance(x, (list, tuple, dict)))
    return deepest


def parse_yaml(text: str, what: str, limit: int = MAX_DEPTH, error: type[Exception] = InputRefused) -> Any:
    """YAML (``yaml.safe_load``) nested at most ``limit`` deep; a parse error is the caller's
    (``yaml.YAMLError`` passes through, for the caller's wording)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise InputRefused(f"{what}: YAML nested too deep to read; not read") from None
    if value_depth(data) > limit:
        raise InputRefused(f"{what}: YAML nested deeper than {limit} levels; not read")
    return data


def lines(f: IO[bytes], what: str, max_line: int, error: type[Exception] = InputRefused) -> Iterator[tuple[int, bytes]]:
    """The lines of an open binary file, numbered from 1, each without its line end and at most
    ``max_line`` bytes: a longer one (a file of zeros has no line end) is refused there, read no further."""
    for n in itertools.count(1):
        raw = f.readline(max_line + 2)
        if not raw:
            return
        body = raw.rstrip(b"\r\n")
        if len(body) > max_line:
            raise InputRefused(f"{what}: line {n} is longer than {human_bytes(max_line)}; not read further")
        yield n, body


def _cut_off(e: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is the text ending (more may come), not a fault inside it."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip()) - 6


def json_array_items(f: IO[bytes], what: str, max_item: int, limit: int = MAX_DEPTH, chunk: int = 1 << 20,
                     error: type[Exception] = InputRefused) -> Iterator[tuple[int, Any]]:
    """The items of a file holding one JSON array, parsed one at a time (numbered from 0), each at
    most ``max_item`` bytes of text and nested at most ``limit`` deep below the array: the array is
    never held whole, only the item being read and the next chunk."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8-sig")("strict")
    buf, pos, eof = "", 0, False

    def more() -> None:
        nonlocal buf, pos, eof
        if eof:
            return
        data = f.read(max(chunk, len(buf) - pos))  # doubling what is held: an item read in few tries
        eof = not data
        try:
            buf = buf[pos:] + utf8.decode(data, final=eof)
        except UnicodeDecodeError:
            raise error(f"{what}: not UTF-8 text") from None
        pos = 0

    def skip_space() -> None:
        nonlocal pos
        while True:
            pos = _SPACE.match(buf, pos).end()
            if pos < len(buf) or eof:
                return
            more()

    skip_space()
    if buf[pos:pos + 1] != "[":
        raise error(f"{what}: not a JSON array")
    pos += 1
    for n in itertools.count():
        skip_space()
        if buf[pos:pos + 1] == "]":
            pos += 1
            skip_space()
            if pos < len(buf):
                raise error(f"{what}: text after the JSON array")
            return
        if n:
            if pos >= len(buf):
                raise error(f"{what}: cut off after item {n - 1}")
            if buf[pos] != ",":
                raise error(f"{what}: item {n}: expected ',' or ']' between items")
            pos += 1
            skip_space()
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
                if end < len(buf) or eof:  # a number at the chunk's end may go on in the next
                    break
            except RecursionError:
                raise InputRefused(f"{what}: item {n}: JSON nested too deep to read; not read") from None
            except json.JSONDecodeError as e:
                if eof or not _cut_off(e, buf):
                    raise error(f"{what}: item {n}: not JSON ({e.msg})") from None
            if len(buf) - pos > max_item:
                raise InputRefused(f"{what}: item {n} is longer than {human_bytes(max_item)}; not read further")
            more()
        if end - pos > max_item:
            raise InputRefused(f"{what}: item {n} is longer than {human_bytes(max_item)}; not read further")
        if depth_over(buf[pos:end], limit):
            raise InputRefused(f"{what}: item {n}: JSON nested deeper than {limit} levels; not read")
        pos = end
        yield n, item
