"""Whether an artifact's files are the bytes its provenance records: the one check that validate,
status, serve, publish and the runner share.

Every file the provenance lists must be there, be a regular file, have its recorded size and
sha256; no other build output may be there (reports and the work folder are not build outputs:
``core.artifact``). Each problem is one line naming the file; the first by name leads.

Hashing a 62 GB artifact at every ``serve`` would take a minute, so digests are cached in
``.hybrid-build/artifact-sha256.json`` (``source_identity.DigestCache``, the source's format), keyed
by the file's name in the artifact and ``source_identity.stat_key``: size, mtime, ctime, inode and
device. A file cannot be written without its ctime moving (the kernel sets it; no user call sets it
back), so a byte changed in place with size and mtime restored is hashed again; an unchanged file
costs one ``stat``. A file written to within ``RACY_NS`` of its hashing is not cached: the kernel's
timestamps advance by clock ticks (a few ms; seconds on some filesystems), and a second write in
the same tick as the first would leave its stat unchanged (git's "racily clean" files). The cache
is a record of this folder's own reads: whoever can write the
artifact can write it too, so it guards against accidents and stale copies, not against the
folder's owner; removing it makes the next check hash everything.

A FIFO, socket or device where a regular file is expected is refused from its ``stat`` alone and
never opened; a regular file is opened non-blocking and checked again on the open descriptor, so a
FIFO put in its place between the two cannot hang the check.
"""
from __future__ import annotations

import os
import stat as stat_mod
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .artifact import (
    ARTIFACT_DIGESTS,
    PROVENANCE,
    artifact_path,
    is_validate_record,
    read_provenance,
    sealed_files,
    unexpected_files,
)
from .byte_units import human_bytes
from .errors import ArtifactError
from .manifest import HASH_CHUNK
from .progress import ProgressFactory, close_bar, null_progress
from .safetensors_io import special_kind
from .source_identity import HASH_THREADS, DigestCache, stat_key

if TYPE_CHECKING:
    from .provenance import FileEntry, Provenance

RACY_NS = 2_000_000_000  # a file whose ctime is this recent when hashed is not cached (see above)


def now_ns() -> int:
    """The clock a file's ctime is compared with (tests move it)."""
    return time.time_ns()


class ChangedWhileReading(Exception):
    """The file moved under the check (another file, or written to, while it was read)."""



def first_problem(problems: list[str]) -> str | None:
    """The first problem, and how many more there are, in one line (None: none)."""
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")

@dataclass
class Integrity:
    """What one check found: counts, and one line per problem (sorted by file name)."""

    files: int = 0  # files the provenance lists
    bytes: int = 0  # their recorded sizes
    cached: int = 0  # sha256 known from the cache (one stat each)
    hashed: int = 0  # read and hashed by this check
    hashed_bytes: int = 0
    matched: int = 0  # listed files whose bytes are the recorded ones
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    by_file: dict[str, str] = field(default_factory=dict)  # file -> its problem
    unexpected: list[str] = field(default_factory=list)  # build outputs present that the provenance does not list

    @property
    def intact(self) -> bool:
        return not self.problems

    @property
    def problem(self) -> str | None:
        """The first problem, and how many more there are, in one line (None: intact)."""
        return first_problem(self.problems)

    def summary(self) -> str:
        return (f"{self.files} files, {human_bytes(self.bytes)} checked against {PROVENANCE}: {self.cached} "
                f"from the hash cache, {self.hashed} hashed ({human_bytes(self.hashed_bytes)}) in "
                f"{self.seconds:.2f} s")

    def to_json(self) -> dict:
        return {"intact": self.intact, "problem": self.problem, "problems": self.problems, "files": self.files,
                "bytes": self.bytes, "cached": self.cached, "hashed": self.hashed,
                "hashed_bytes": self.hashed_bytes, "matched": self.matched, "seconds": round(self.seconds, 3)}


def hash_file(path: Path, expect: os.stat_result) -> str:
    """sha256 of the regular file ``path`` whose ``stat`` was ``expect``. Opened non-blocking (a FIFO
    swapped in since the ``stat`` returns at once instead of waiting for a writer) and checked on
    the descriptor before and after the read; raises ``ChangedWhileReading`` when it is not that
    file any more or was written to meanwhile. Tests count calls to it."""
    import hashlib

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
            raise ChangedWhileReading("it was replaced while it was being checked")
        h = hashlib.sha256()
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        if stat_key(os.fstat(fd)) != stat_key(expect):
            raise ChangedWhileReading("it changed while it was being read")
        return h.hexdigest()
    finally:
        os.close(fd)


def check_artifact(artifact: Path, provenance: Provenance | None = None, progress: ProgressFactory = null_progress,
                   names: list[str] | None = None, reports: bool = True) -> Integrity:
    """Check ``artifact`` against ``provenance`` (default: its own, which must exist). ``names``
    limits the check to those listed files (no search for extra files): what publish re-checks
    just before sending a part. ``reports``: the reports too, against the provenance's ``reports``
    section (a report it does not record is a problem); ``validate``, which rewrites them, and the
    runner check the build's outputs alone."""
    t0 = time.perf_counter()
    artifact = Path(artifact)
    prov = provenance if provenance is not None else read_provenance(artifact)
    listed = {**prov.files, **(prov.reports or {})} if reports else prov.files
    wanted = sorted(listed) if names is None else sorted(n for n in names if n in listed)
    result = Integrity(files=len(wanted), bytes=sum(listed[n].bytes for n in wanted))
    found: dict[str, str] = {}  # name -> its problem
    if names is None:
        result.unexpected = unexpected_files(artifact, prov)  # reports written after the build are expected
        for name in result.unexpected:
            found[name] = f"{name} is not listed in {PROVENANCE}"
        if reports:
            for name in sealed_files(artifact):
                if name not in listed:
                    found[name] = (f"{name} is not recorded in {PROVENANCE} (written or replaced by hand: run the "
                                   "command that writes it again)")
    cache = DigestCache(artifact / ARTIFACT_DIGESTS)
    todo: list[tuple[str, os.stat_result]] = []
    for name in wanted:
        want = listed[name]
        try:
            path = artifact_path(artifact, name)  # a folder on the way that links outside: never read
        except ArtifactError as e:
            found[name] = str(e).removeprefix(f"{artifact}: ")
            continue
        try:
            st = os.lstat(path)  # a symlink is refused, never followed
        except FileNotFoundError:
            if name not in prov.files and not is_validate_record(name):
                continue  # a report removed: it is missing, as the commands that need it say (not an edit)
            found[name] = f"{name} is listed in {PROVENANCE} but missing from the artifact"
            continue
        except OSError as e:
            found[name] = f"{name} cannot be read ({e.strerror or type(e).__name__})"
            continue
        kind = special_kind(st)
        if kind:  # never opened: reading a FIFO would wait for a writer
            found[name] = f"{name} is {kind}, not a regular file"
        elif st.st_size != want.bytes:
            found[name] = f"{name} has {st.st_size} bytes, {PROVENANCE} records {want.bytes}"
        elif not want.sha256:
            found[name] = f"{name}: {PROVENANCE} records no sha256 (an old build: rebuild it)"
        else:
            sha = cache.lookup(Path(name), stat_key(st))
            if sha is None:
                todo.append((name, st))
            else:
                result.cached += 1
                if sha != want.sha256:
                    found[name] = _differs(name, sha, want.sha256)
                else:
                    result.matched += 1
    _hash(artifact, todo, listed, cache, found, result, progress)
    result.by_file = dict(sorted(found.items()))
    result.problems = list(result.by_file.values())
    result.seconds = time.perf_counter() - t0
    return result


def _differs(name: str, got: str, want: str) -> str:
    return f"{name} has other bytes than {PROVENANCE} records (sha256 {got[:12]}..., recorded {want[:12]}...)"


def _hash(artifact: Path, todo: list[tuple[str, os.stat_result]], listed: dict[str, FileEntry], cache: DigestCache,
          found: dict[str, str], result: Integrity, progress: ProgressFactory) -> None:
    if not todo:
        return
    bar = progress(total=sum(st.st_size for _, st in todo), desc="sha256", unit="B", unit_scale=True)

    def one(item: tuple[str, os.stat_result]) -> tuple[str, str | None, str | None]:
        name, st = item
        settled = st.st_ctime_ns <= now_ns() - RACY_NS  # else a write in the same clock tick could hide
        try:
            sha = hash_file(artifact / name, st)
        except ChangedWhileReading as e:
            return name, None, f"{name}: {e}; check again once it is stable"
        except OSError as e:
            return name, None, f"{name} cannot be read ({e.strerror or type(e).__name__})"
        if settled:
            cache.put(Path(name), stat_key(st), sha)
        bar.update(st.st_size)
        return name, sha, None

    try:
        # largest first, so that the threads finish together (sha256 releases the GIL)
        with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="hash-artifact") as pool:
            done = list(pool.map(one, sorted(todo, key=lambda i: -i[1].st_size)))
    finally:
        close_bar(bar)
    for name, sha, problem in done:
        if problem:
            found[name] = problem
            continue
        result.hashed += 1
        result.hashed_bytes += listed[name].bytes
        if sha != listed[name].sha256:
            found[name] = _differs(name, sha, listed[name].sha256)
        else:
            result.matched += 1
