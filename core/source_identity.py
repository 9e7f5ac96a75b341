"""What a build's source is: where it lives and what its bytes are.

A source is identified by content: the sha256 of every file the build reads (config, every
safetensors file, and the files copied into the artifact such as the tokenizer). Hashing 62 GB
costs about a minute of CPU, so digests are cached in ``OUT/.hybrid-build/source-sha256.json``
keyed by absolute path and what a file cannot change without (``stat_key``: size, mtime, ctime,
inode, device): a resumed run, a later ``validate`` or ``serve`` re-hashes nothing, and a file
that was written to (even with its size and mtime put back: the kernel sets ctime) is hashed
again. The artifact's own files use the same cache format (``core.integrity``). Files of
a Hub snapshot need no hashing at all: huggingface_hub stores each LFS file under its sha256.

On a fresh build the digests are computed on a background thread while the stages run: the
stages read the same bytes, so the hashing reads come from the page cache they fill, and the
CPU it needs overlaps their I/O. A stage whose manifest might be reused waits for them first.

Where the source is goes into ``OUT/.hybrid-build/source.json`` (absolute path, and for the demo
its place inside the artifact); what it is goes into the provenance (kind, id, resolved Hub
revision, per-file sha256, fingerprint). The absolute path stays out of the provenance on
purpose: the provenance is published with the artifact, a machine's folder names are not.
``open_recorded_source`` reopens a source from either and refuses one whose bytes differ.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .artifact import WORK_DIR
from .bounded_read import SMALL_JSON, InputRefused, read_json
from .errors import SourceMismatch, UserError
from .manifest import sha256_file, sha256_json
from .names import name_problem
from .progress import ProgressFactory, close_bar, null_progress
from .safetensors_io import TMP_SUFFIX, write_text_atomic

if TYPE_CHECKING:
    from .provenance import Provenance

log = logging.getLogger(__name__)

DIGEST_CACHE = "source-sha256.json"
LOCATION_FILE = "source.json"
HASH_THREADS = 2  # sha256 runs ~1.1 GB/s a core and releases the GIL
_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")


def source_files(root: Path) -> list[str]:
    """Every file the build reads or copies: all regular files outside dot-folders, relative, sorted."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or p.name.endswith(TMP_SUFFIX) or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def stat_key(st: os.stat_result) -> dict:
    """What a file cannot change without, as the digest caches key it: size, mtime, ctime (set by
    the kernel on every write and never settable by a user, so a change with size and mtime put
    back still shows), inode and device (another file in its place)."""
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def _stat_key(path: Path) -> dict:
    return stat_key(path.stat())  # follows a Hub snapshot's symlink to its blob


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 of a Hub snapshot file, read from its blob's name (LFS blobs are named by it)."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _SHA256_NAME.match(target.name):
        return target.name
    return None


class DigestCache:
    """A JSON file of name -> ``stat_key`` fields and sha256 (``source-sha256.json``: absolute paths;
    ``artifact-sha256.json``: names inside the artifact). An entry counts only when every field
    matches the file's stat now; an entry written by an older version (fewer fields) never does."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._unsaved: str | None = None  # why the file could not be written (a read-only folder)
        self.entries: dict[str, dict] = {}
        if path is not None and path.exists():
            try:
                self.entries = read_json(path, path.name).get("files", {})
            except (OSError, InputRefused, AttributeError):
                log.warning("%s: unreadable digest cache; source files will be hashed again", path)

    def lookup(self, path: Path, stat: dict) -> str | None:
        e = self.entries.get(str(path))
        if e and all(e.get(k) == v for k, v in stat.items()):
            return e.get("sha256")
        return None

    def put(self, path: Path, stat: dict, sha: str) -> None:
        with self._lock:
            self.entries[str(path)] = {**stat, "sha256": sha}
            if self.path is None or self._unsaved:
                return
            try:  # saved per file, so an interrupted run keeps what it hashed
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(self.path, json.dumps({"files": self.entries}, indent=1, sort_keys=True) + "\n")
            except OSError as e:  # a read-only folder: the check still holds, the next one hashes again
                self._unsaved = e.strerror or type(e).__name__
                log.warning("%s: cannot save the digest cache (%s); files will be hashed again next time",
                            self.path, self._unsaved)


class SourceDigests:
    """The sha256 of every file of a source folder: cached, Hub-named, or computed here."""

    def __init__(self, root: Path, cache_path: Path | None = None) -> None:
        self.root = Path(root).resolve()
        self.files = source_files(self.root)
        self._cache = DigestCache(cache_path)
        self._stats = {f: _stat_key(self.root / f) for f in self.files}
        self._sha: dict[str, str] = {}
        for f in self.files:
            sha = hub_blob_sha256(self.root / f) or self._cache.lookup(self.root / f, self._stats[f])
            if sha:
                self._sha[f] = sha
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        if not self.missing:
            self._done.set()

    def stat(self, name: str) -> dict:
        """The file's ``stat_key`` as read when this object was made."""
        return dict(self._stats[name])

    @property
    def missing(self) -> list[str]:
        return [f for f in self.files if f not in self._sha]

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def compute(self, progress: ProgressFactory = null_progress) -> None:
        """Hash the files not known yet, here and now."""
        todo = self.missing
        if not todo:
            self._done.set()
            return
        bar = progress(total=sum(self._stats[f]["bytes"] for f in todo), desc="hash source", unit="B", unit_scale=True)

        def one(name: str) -> None:
            path = self.root / name
            sha = sha256_file(path)
            if _stat_key(path) != self._stats[name]:
                raise UserError(f"{path}: changed while it was being read; run again once the source is stable")
            self._cache.put(path, self._stats[name], sha)
            self._sha[name] = sha
            bar.update(self._stats[name]["bytes"])

        try:
            # largest first, so that the two threads finish together
            with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="hash-source") as pool:
                list(pool.map(one, sorted(todo, key=lambda f: -self._stats[f]["bytes"])))
        finally:
            close_bar(bar)
        self._done.set()

    def start(self) -> None:
        """Hash the missing files on a background thread; ``result`` waits for it."""
        if self.ready or self._thread is not None:
            return

        def run() -> None:
            try:
                self.compute()
            except BaseException as e:  # noqa: BLE001  (raised by result())
                self._error = e
                self._done.set()

        self._thread = threading.Thread(target=run, name="hash-source", daemon=True)
        self._thread.start()

    def result(self, progress: ProgressFactory = null_progress) -> dict[str, dict]:
        """name -> {"bytes", "sha256"} for every file; computes or waits for what is missing."""
        if self._thread is not None:
            self._done.wait()
        elif not self.ready:
            self.compute(progress)
        if self._error is not None:
            raise self._error
        return {f: {"bytes": self._stats[f]["bytes"], "sha256": self._sha[f]} for f in self.files}

    def fingerprint(self, progress: ProgressFactory = null_progress) -> str:
        return fingerprint_of(self.result(progress))


def fingerprint_of(files: dict[str, dict]) -> str:
    """One hash for a source: over its files' names, sizes and sha256."""
    return sha256_json({f: {"bytes": i["bytes"], "sha256": i["sha256"]} for f, i in sorted(files.items())})


# ------------------------------------------------------------------------------ recorded identity


@dataclass
class SourceRecord:
    """What the provenance says about the source, and (locally) where it was."""

    kind: str  # "local" | "hub"
    id: str  # Hub repo id, or the folder's name
    revision: str | None  # the resolved Hub commit
    fingerprint: str | None
    files: dict[str, dict]  # name -> bytes, sha256 (sha256 absent in provenance before schema 2)
    path: str | None = None  # absolute folder (from OUT/.hybrid-build/source.json)
    in_artifact: str | None = None  # the demo source: its place inside the artifact

    def to_provenance(self) -> dict:
        return {"kind": self.kind, "id": self.id, "revision": self.revision, "fingerprint": self.fingerprint,
                "files": self.files}

    def to_location(self) -> dict:
        return {"path": self.path, "in_artifact": self.in_artifact, "fingerprint": self.fingerprint}

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.id}@{(self.revision or 'main')[:12]}"
        return self.path or self.id


def record_for(root: Path, hub_id: str | None, revision: str | None, files: dict[str, dict],
               in_artifact: str | None = None) -> SourceRecord:
    root = Path(root).resolve()
    if hub_id:
        return SourceRecord("hub", hub_id, revision, fingerprint_of(files), files)
    return SourceRecord("local", root.name, None, fingerprint_of(files), files, str(root), in_artifact)


def read_record(artifact: Path, provenance: Provenance | None) -> SourceRecord | None:
    """The source as the artifact records it: provenance's identity plus the local location file."""
    src = provenance.source if provenance is not None else {}
    if not src.get("id"):
        return None
    loc = {}
    loc_path = Path(artifact) / WORK_DIR / LOCATION_FILE
    if loc_path.exists():
        try:
            loc = read_json(loc_path, LOCATION_FILE, SMALL_JSON)
        except (OSError, InputRefused):
            loc = {}
        if loc.get("fingerprint") != src.get("fingerprint"):
            loc = {}  # written for another build of this folder
    # schema 1 had no kind: a local source was recorded by folder name, which has no "/"
    kind = src.get("kind") or ("hub" if "/" in src["id"] else "local")
    inside = loc.get("in_artifact")
    if name_problem(inside):  # the demo source lives below the artifact, or it is not the demo's
        inside = None
    return SourceRecord(kind, src["id"], src.get("revision"), src.get("fingerprint"), src.get("files") or {},
                        loc.get("path"), inside)


def mismatch(record: SourceRecord, actual: dict[str, dict]) -> str | None:
    """Why ``actual`` (name -> bytes, sha256) is not the recorded source, or None if it is."""
    for name, info in sorted(record.files.items()):
        got = actual.get(name)
        if got is None:
            return f"it has no {name}"
        if info.get("bytes") is not None and got["bytes"] != info["bytes"]:
            return f"{name} has {got['bytes']} bytes, the build read {info['bytes']}"
        if info.get("sha256") and got["sha256"] != info["sha256"]:
            return f"{name} has sha256 {got['sha256'][:12]}..., the build read {info['sha256'][:12]}..."
    return None


def verify_source(record: SourceRecord, root: Path, cache_path: Path | None,
                  progress: ProgressFactory = null_progress) -> None:
    """Raise ``SourceMismatch`` unless the folder holds the bytes the artifact was built from."""
    has_sha = any(i.get("sha256") for i in record.files.values())
    if has_sha:
        actual = SourceDigests(root, cache_path).result(progress)
    else:  # provenance written before content fingerprints: sizes are all it has
        log.warning("the artifact's provenance records file sizes only; rebuild it to record content hashes")
        actual = {f: {"bytes": (Path(root) / f).stat().st_size, "sha256": None} for f in record.files
                  if (Path(root) / f).is_file()}
    why = mismatch(record, actual)
    if why:
        raise SourceMismatch(f"{root}: not the source this artifact was built from ({record.id}): {why}. "
                             f"Pass --source with the checkpoint it was built from, or rebuild the artifact")


def open_recorded_source(artifact: Path, provenance: Provenance | None, given: str | os.PathLike | None = None,
                         progress: ProgressFactory = null_progress):
    """The source checkpoint of ``artifact``: ``given`` if set, else the one it records, checked by
    content against the provenance. A source that differs is one error (exit 2), never a report."""
    from .checkpoint import HUB_ID, Checkpoint

    artifact = Path(artifact).resolve()
    record = read_record(artifact, provenance)
    cache = artifact / WORK_DIR / DIGEST_CACHE
    if given is not None:
        ckpt = Checkpoint.open(given)
    elif record is None:
        raise UserError("the artifact's provenance names no source: pass --source")
    else:
        ckpt = None
        candidates = [artifact / record.in_artifact] if record.in_artifact else []
        candidates += [Path(record.path)] if record.path else []
        for cand in candidates:
            if (cand / "config.json").is_file():
                ckpt = Checkpoint.open(cand)
                break
        if ckpt is None and record.kind == "hub" and HUB_ID.match(record.id):
            ckpt = Checkpoint.open(record.id, revision=record.revision)
        if ckpt is None:
            where = f" at {record.path}" if record.path else ""
            raise UserError(f"the artifact was built from the local checkpoint {record.id!r}{where}, which is not "
                            f"there any more: pass --source")
    if record is not None:
        verify_source(record, ckpt.root, cache, progress)
    return ckpt
