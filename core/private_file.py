"""Files only their owner can read, for secrets (a served API's key, a Ray token): written whole or
not at all, and never over a file that is there already; and the rule a secret keeps: one word."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from .bounded_read import SECRET_CAP, read_text
from .errors import UserError


def is_one_word(secret: str) -> bool:
    """True when ``secret`` is not empty and holds no whitespace (a key or token is one word)."""
    return bool(secret) and not any(c.isspace() for c in secret)


def write_private(path: Path, text: str) -> bool:
    """Write ``text`` to ``path``, readable by its owner only, in a folder created 0700 if missing.
    The text goes under a temporary name created 0600 (``O_EXCL``, ``O_NOFOLLOW``: never someone
    else's file, never readable by others whatever the umask, never half-written), which is then
    hard-linked to ``path``. False when ``path`` exists (a symlink too): it is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails where path exists: a file another run wrote is never replaced
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            if path.exists() or path.is_symlink():
                return False
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def read_private(path: Path, what: str) -> str:
    """The stripped text of ``path``, a regular file of this user that nobody else can read or
    write; else one line (``what`` names it) saying what to do."""
    try:
        st = path.stat()
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {path}: not a file")
    if st.st_uid != os.getuid():
        raise UserError(f"{what} {path}: owned by another user; a secret must be in a file of yours")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise UserError(f"{what} {path}: can be read or written by others (mode {mode:04o}): `chmod 600 {path}`")
    try:  # read through core/bounded_read: a FIFO swapped in since the stat is refused, not waited on
        return read_text(path, f"{what} {path}", SECRET_CAP, UserError).strip()
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
