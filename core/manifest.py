"""Stage manifests and fingerprints: what a stage read, with which parameters, and what it wrote.

A stage is skipped when its manifest's input key still matches and every output it recorded is
still there with the recorded size (and hash, for files small enough to hash quickly). The key
hashes the source's identity (file names, sizes and header hashes; config.json), the recipe
section the stage uses, the tool version and the keys of the stages it depends on.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .bounded_read import SMALL_JSON, InputRefused, open_regular, parse_json, read_bytes
from .safetensors_io import write_text_atomic

HASH_CHUNK = 16 * 1024 * 1024
QUICK_HASH_LIMIT = 64 * 1024 * 1024  # outputs up to this size are re-hashed when checking a manifest


def sha256_file(path: Path, on_bytes: Callable[[int], object] | None = None) -> str:
    """sha256 of a file read in 16 MiB chunks; ``on_bytes`` (a progress bar's update) sees each."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open_regular(path, Path(path).name) as f:  # a FIFO in a file's place is refused, never waited on
        while n := f.readinto(buf):
            h.update(view[:n])
            if on_bytes:
                on_bytes(n)
    return h.hexdigest()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class StageManifest:
    stage: str
    key: str
    inputs: dict
    outputs: dict[str, dict] = field(default_factory=dict)  # path relative to the output folder -> bytes, sha256
    details: dict = field(default_factory=dict)
    seconds: float = 0.0
    finished_at: float = 0.0

    @classmethod
    def load(cls, path: Path) -> "StageManifest | None":
        """The manifest at ``path`` if this machine wrote it; None otherwise (``read`` says why)."""
        return cls.read(path)[0]

    @classmethod
    def read(cls, path: Path) -> "tuple[StageManifest | None, str]":
        """``(manifest, "")``, or ``(None, why)``: no file, unreadable, or bytes this machine did not write.
        A manifest tells the runner what it need not redo, and a folder from elsewhere can carry any
        file: only one whose sha256 this machine recorded when it wrote it (``core.local_trust``) counts."""
        from . import local_trust

        if not path.exists():
            return None, "no manifest"
        try:
            raw = read_bytes(path, path.name, SMALL_JSON)
        except (OSError, InputRefused) as e:
            return None, f"manifest unreadable ({e})"
        if not local_trust.recalled(hashlib.sha256(raw).hexdigest(), local_trust.STAGE_MANIFEST):
            return None, "its manifest was not written on this machine (or was changed since)"
        try:
            return cls(**parse_json(raw, path.name)), ""
        except (InputRefused, TypeError) as e:
            return None, f"manifest unreadable ({e})"

    def save(self, path: Path) -> None:
        """Write the manifest, and record its sha256 as written here (``read``)."""
        from . import local_trust

        text = json.dumps(asdict(self), indent=2, default=str) + "\n"
        try:  # the record of the manifest this one replaces goes: one record per manifest there is
            local_trust.forget(hashlib.sha256(read_bytes(path, path.name, SMALL_JSON)).hexdigest(),
                               local_trust.STAGE_MANIFEST)
        except (OSError, InputRefused):
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        local_trust.remember(hashlib.sha256(text.encode()).hexdigest(), local_trust.STAGE_MANIFEST, path.parent.parent,
                             stage=self.stage)
        write_text_atomic(path, text)

    def still_valid(self, root: Path, key: str) -> bool:
        return self.key == key and self.output_problem(root) is None

    def output_problem(self, root: Path, known: dict[str, str] | None = None) -> str | None:
        """The first recorded output that is missing or changed, in words (None: all intact).
        Files up to ``QUICK_HASH_LIMIT`` are hashed again, unless ``known`` has their sha256 (checked
        already, e.g. by ``core.bound.open_artifact``; for the provenance, the build's name); larger
        ones are compared by size."""
        for rel, info in sorted(self.outputs.items()):
            p = root / rel
            if not p.is_file():
                return f"{rel} is missing"
            if rel == PROVENANCE_REL and ((known or {}).get(rel) == info.get("sha256") if known and rel in known
                                          else _same_build(p, info)):
                continue  # the provenance, with the reports sealed since: the same build (known: by its name)
            if p.stat().st_size != info.get("bytes"):
                return f"{rel} has {p.stat().st_size} bytes, the stage wrote {info.get('bytes')}"
            if info.get("sha256") and info["bytes"] <= QUICK_HASH_LIMIT and \
                    ((known or {}).get(rel) or sha256_file(p)) != info["sha256"]:
                return f"{rel} changed since the stage wrote it"
        return None


PROVENANCE_REL = "hybrid_build/provenance.json"  # core.artifact.PROVENANCE (which imports this module)


def build_digest(raw: bytes) -> str:
    """sha256 of a provenance file's bytes without its ``reports`` section (``core.artifact``'s
    ``seal_reports`` adds it after the build): the build's name, whatever reports were sealed since."""
    if b'"reports"' in raw:
        try:
            data = parse_json(raw, "provenance")
        except InputRefused:
            data = None
        if isinstance(data, dict) and "reports" in data:
            data.pop("reports")
            raw = (json.dumps(data, indent=2) + "\n").encode()  # Provenance.to_text's layout
    return hashlib.sha256(raw).hexdigest()


def _same_build(path: Path, info: dict) -> bool:
    try:
        return build_digest(read_bytes(path, path.name)) == info.get("sha256")
    except (OSError, InputRefused):
        return False


def describe_outputs(root: Path, paths: list[Path], hashes: dict[str, str] | None = None) -> dict[str, dict]:
    out = {}
    for p in paths:
        rel = os.path.relpath(p, root)
        size = p.stat().st_size
        sha = (hashes or {}).get(rel) or (sha256_file(p) if size <= QUICK_HASH_LIMIT else None)
        out[rel] = {"bytes": size, "sha256": sha}
    return out
