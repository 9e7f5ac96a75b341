"""Files only their owner can read, for secrets (a served API's key, a Ray token): written whole or
not at all, and never over a file that is there already."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


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
