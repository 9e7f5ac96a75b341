"""What this machine vouches for about a build: that it built it, that a ``validate`` here passed for
it, that a signature was verified here. Kept in the user's state folder, never in the artifact: a
folder that came from elsewhere (a Hub download, a copy from another machine) can carry any file,
so a claim it carries about itself is worth nothing. pip's and huggingface_hub's caches keep their
own records beside what they fetched in the same way.

The runner's stage manifests count the same way: one written here is recorded by the sha256 of its
bytes (``STAGE_MANIFEST``), and a manifest without such a record never lets a stage be skipped.

A record is keyed by the build's digest (``core.manifest.build_digest`` of its provenance: every
output file's sha256, reports aside), so it holds for any folder whose files are those bytes,
wherever it is; ``core.bound.open_artifact`` checks the bytes before it asks. The folder the record
was made for is kept in it, to say where.

Where: ``$HYBRID_BUILD_TRUST_DIR`` when set, else ``trust`` in the user's state folder
(``core.state_dir``: ``$HYBRID_BUILD_STATE_DIR``, else ``$XDG_STATE_HOME/hybrid-build``, else
``~/.local/state/hybrid-build``). Each record is written whole under a temporary name and renamed;
each is read back as a regular file of at most ``SMALL_JSON`` bytes (``core.bounded_read``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .bounded_read import SMALL_JSON, InputRefused, read_json
from .state_dir import state_dir

TRUST_ENV = "HYBRID_BUILD_TRUST_DIR"
BUILT, VALIDATED = "built", "validated"
# a stage manifest written here, keyed by the sha256 of its bytes (``core.manifest.StageManifest``)
STAGE_MANIFEST = "stage-manifest"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def trust_dir() -> Path:
    """Where this machine's records are kept (the module's docstring)."""
    given = os.environ.get(TRUST_ENV, "")
    return Path(given).expanduser() if given else state_dir() / "trust"


def _path(build: str, kind: str) -> Path:
    if not _DIGEST.match(build or ""):
        raise ValueError(f"not a build digest: {build!r}")
    return trust_dir() / build / f"{kind}.json"


def remember(build: str, kind: str, folder: Path, **details) -> Path:
    """Record that this machine ``kind`` (``BUILT``, ``VALIDATED``) the build ``build`` in ``folder``, or
    wrote the stage manifest whose sha256 is ``build`` (``STAGE_MANIFEST``) in the output folder ``folder``."""
    from .clock import utc_now
    from .safetensors_io import write_text_atomic

    path = _path(build, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"build": build, kind: str(Path(folder).resolve()), "at": utc_now(), **details}
    return write_text_atomic(path, json.dumps(record) + "\n")


def forget(build: str, kind: str) -> None:
    """Drop the record (a later ``validate`` here did not pass; a stage manifest replaced by another)."""
    path = _path(build, kind)
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()  # the digest's folder, once it holds no record
    except OSError:
        pass


def recalled(build: str | None, kind: str) -> dict | None:
    """The record of ``kind`` for ``build``, or None (none, unreadable, or made for another build)."""
    if not build or not _DIGEST.match(build):
        return None
    try:
        data = read_json(_path(build, kind), f"the {kind} record", SMALL_JSON)
    except (OSError, InputRefused):
        return None
    return data if isinstance(data, dict) and data.get("build") == build else None


def verdict_key(signature: bytes, files: dict[str, str], anchors: list[bytes]) -> str:
    """The name of a signature check's verdict: the signature's bytes, the digests of the files it was
    checked against and the trusted keys or certificates it was checked with; any other input is
    another check."""
    import hashlib

    h = hashlib.sha256()
    h.update(hashlib.sha256(signature).digest())
    h.update(json.dumps(sorted(files.items())).encode())
    for a in sorted(hashlib.sha256(a).digest() for a in anchors):
        h.update(a)
    return h.hexdigest()


def remember_verdict(key: str, signer: str, files: int) -> None:
    """A signature that verified here (``core.signing``): the next check of the same inputs needs not
    hash the files again."""
    from .clock import utc_now
    from .safetensors_io import write_text_atomic

    path = trust_dir() / "signatures" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"key": key, "signer": signer, "files": files, "at": utc_now()}) + "\n")


def recalled_verdict(key: str) -> dict | None:
    try:
        data = read_json(trust_dir() / "signatures" / f"{key}.json", "a signature verdict", SMALL_JSON)
    except (OSError, InputRefused):
        return None
    return data if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("signer"), str) else None
