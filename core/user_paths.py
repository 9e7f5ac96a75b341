"""The paths a user names on the command line: a text file to read (a recipe, validate's texts), and
a file or folder a command will write. Each is refused in one line (a ``UserError``, exit 2)
before anything is read or written when it cannot be what is asked: missing, a folder where a file
is expected, a FIFO, device or socket (reading one would block or never end), a symbolic-link loop,
a parent that is a file, a file that is not UTF-8 text.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .byte_units import human_bytes
from .errors import StorageError, UserError

_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    return next((word for test, word in _SPECIAL if test(mode)), "not a regular file")


def _stat_error(path: Path, what: str, e: OSError) -> UserError:
    if e.errno == errno.ELOOP:
        return UserError(f"{what} {path}: a loop of symbolic links")
    if e.errno == errno.ENOTDIR:
        return UserError(f"{what} {path}: a part of the path is a file, not a folder")
    if e.errno == errno.ENOENT:
        return UserError(f"{what} {path}: no such file")
    return UserError(f"{what} {path}: {e.strerror or e}")


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path``, checked to be a regular file (symbolic links followed) before it is opened."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise _stat_error(p, what, e) from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{what} {p}: {kind_of(mode)}, not a regular file")
    return p


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of a regular file; one line for anything else (binary data included: a NUL
    byte or bytes that are not UTF-8)."""
    p = regular_file(path, what)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise _stat_error(p, what, e) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {p}: not a UTF-8 text file (byte {e.start} is 0x{data[e.start]:02x})") from None
    if "\x00" in text:
        raise UserError(f"{what} {p}: not a text file (it holds NUL bytes at byte {text.index(chr(0))})")
    return text


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest existing parent: where a folder not yet made will live."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def require_free_space(folder: str | os.PathLike, need: int, what: str, replaced: Iterable[Path] = ()) -> None:
    """Refuse, before anything is written, ``need`` bytes that ``folder``'s filesystem cannot hold
    (the files in ``replaced`` give their space back when they are renamed over)."""
    back = sum(p.stat().st_size for p in map(Path, replaced) if p.is_file())
    free = shutil.disk_usage(nearest_existing(Path(folder))).free
    if need - back > free:
        raise StorageError(f"{folder}: {human_bytes(free)} free on its filesystem, {what} writes about "
                           f"{human_bytes(need - back)}; free some space or choose another folder")


def check_output_path(path: str | os.PathLike, what: str, folder: bool) -> Path:
    """A file (``folder=False``) or folder a command will create or replace: where it exists it
    must be one (a symbolic link to one is fine), and where it does not, its nearest existing
    parent must be a folder this user may write in. Nothing is created."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise _stat_error(p, what, e) from None
    if mode is None and p.is_symlink():
        raise UserError(f"{what} {p}: a symbolic link to {os.readlink(p)}, which does not exist")
    if mode is not None:
        want, ok = ("a folder", stat.S_ISDIR(mode)) if folder else ("a file", stat.S_ISREG(mode))
        if not ok:
            raise UserError(f"{what} {p}: exists and is {kind_of(mode)}, not {want}")
        return p
    parent = p.absolute().parent
    while True:
        try:
            pmode = parent.stat().st_mode
            break
        except FileNotFoundError:
            if parent.is_symlink():
                raise UserError(f"{what} {p}: {parent} is a symbolic link to {os.readlink(parent)}, which does "
                                "not exist") from None
            parent = parent.parent
        except OSError as e:
            raise _stat_error(p, what, e) from None
    if not stat.S_ISDIR(pmode):
        raise UserError(f"{what} {p}: {parent} is {kind_of(pmode)}, not a folder")
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise UserError(f"{what} {p}: {os.strerror(errno.EROFS)} ({parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} {p}: {parent} is not writable by this user")
    return p
