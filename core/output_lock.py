"""One writer per output folder: ``run`` holds an exclusive ``flock`` on ``RUN_LOCK`` while it writes
and leaves ``IN_PROGRESS`` (its pid, when it started) in the folder until the build is complete.

The lock is the kernel's: it goes with the process, however that ends (``kill -9`` included), so a
second ``run`` refuses at once only while the first is alive, naming its pid. The marker stays
after a run that stopped: ``serve``, ``publish`` and ``status`` then take the folder for a build
that did not finish (``core.bound.unfinished``), never for an artifact nor a source checkpoint.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .artifact import IN_PROGRESS, INDEX, PROVENANCE, RUN_LOCK
from .clock import utc_now
from .errors import CannotRun
from .safetensors_io import write_text_atomic


@contextmanager
def hold_output(out: Path) -> Iterator[None]:
    """Lock ``out`` for this process and mark it in progress; the marker goes when the block ends,
    however, with a complete build in the folder (a provenance and an index), and stays otherwise
    (and after ``kill -9``, which runs no ``finally``)."""
    import fcntl

    out = Path(out)
    lock = out / RUN_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise CannotRun(f"{out}: another `hybrid-build run` (pid {holder}) is writing this folder; wait for it "
                            "to finish, or stop it, and run again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        write_text_atomic(out / IN_PROGRESS, json.dumps({"pid": os.getpid(), "started": utc_now()}) + "\n")
        try:
            yield
        finally:  # a run that failed on a complete build (assemble removes the provenance before a shard)
            if (out / PROVENANCE).is_file() and (out / INDEX).is_file():
                (out / IN_PROGRESS).unlink(missing_ok=True)
    finally:
        os.close(fd)  # releases the lock
