"""The paths a user names on the command line: a text file to read (a recipe, validate's texts), and
a file or folder a command will write. Each is refused in one line (a ``UserError``, exit 2)
before anything is read or written when it cannot be what is asked: missing, a folder where a file
is expected, a FIFO, device or socket (reading one would block or never end), a symbolic-link loop,
a parent that is a file, a file that is not UTF-8 text, a file larger than its cap.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .bounded_read import TEXT_CAP, kind_of, read_text
from .byte_units import human_bytes
from .errors import StorageError, UserError


def _stat_error(path: Path, what: str, e: OSError) -> UserError:
    if e.errno == errno.ELOOP:
        return UserError(f"{what} {path}: a loop of symbolic links")
    if e.errno == errno.ENOTDIR:
        return UserError(f"{what} {path}: a part of the path is a file, not a folder")
    if e.errno == errno.ENOENT:
        return UserError(f"{what} {path}: no such file")
    return UserError(f"{what} {path}: {e.strerror or e}")


def read_text_file(path: str | os.PathLike, what: str, cap: int = TEXT_CAP) -> str:
    """The UTF-8 text of a regular file of at most ``cap`` bytes (``core/bounded_read``); one line
    for anything else (binary data included: a NUL byte or bytes that are not UTF-8)."""
    return read_text(path, f"{what} {Path(path)}", cap, UserError)


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
