"""The provenance manifest (``META_DIR/provenance.json``): what one build wrote, from what, with
what tool and recipe, and when. One typed model, written by the ``record`` stage
(``Provenance.to_text``) and read for every command through ``core.artifact.read_provenance``, which
parses it here.

The JSON keeps its keys and their order across versions, so the bytes of a build stay what they
were; fields a later tool adds are optional here, and keys this version does not know are kept
(``extra="allow"``): an artifact built by a newer hybrid-build still reads.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .errors import ArtifactError
from .names import name_problem

SCHEMA_VERSION = 2  # 2: the source is identified by content (kind, per-file sha256)
TOOL_NAME = "hybrid-build"


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = TOOL_NAME
    version: str = "?"


class FileEntry(BaseModel):
    """One file the build wrote (or copied): its size and sha256."""

    model_config = ConfigDict(extra="allow")

    bytes: int
    sha256: str


class Provenance(BaseModel):
    """``source`` is ``core.source_identity``'s record (``SourceRecord.to_provenance``), ``recipe``
    the resolved recipe as dumped, ``tensors`` and ``converted`` what ``assemble`` reports."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    tool: Tool = Tool()
    format: str | None = None  # None: written before formats were recorded (the default format)
    source: dict[str, Any] = {}
    recipe: dict[str, Any] = {}
    files: dict[str, FileEntry] = {}
    tensors: dict[str, Any] = {}
    converted: list[dict[str, Any]] = []
    created: str | None = None  # UTC, ISO 8601 to the second; None: written before builds were dated
    # the reports written after the build (``core.artifact.seal_reports``), each with its size and sha256;
    # not part of the build's identity (``core.artifact.provenance_sha256`` leaves it out). None: none sealed
    reports: dict[str, FileEntry] | None = None

    @field_validator("files", "reports")
    @classmethod
    def _names_inside(cls, entries: dict[str, FileEntry] | None) -> dict[str, FileEntry] | None:
        """Every entry names a file below the artifact (``core.artifact.name_problem``): a provenance
        that names ``../x`` or ``/etc/x`` is refused whole, before any command opens, hashes or uploads
        by that name."""
        for name in entries or {}:
            why = name_problem(name)
            if why:
                raise ValueError(f"{why}: not a name inside the artifact")
        return entries

    def to_text(self) -> str:
        """The file's text: the keys in the order above, two-space indents, a final newline."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"


def build_time(environ: dict[str, str] | None = None) -> str:
    """When a build is recorded: now, or ``SOURCE_DATE_EPOCH`` where it is set (the reproducible-builds
    convention: the same inputs then give the same provenance bytes)."""
    epoch = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH", "").strip()
    seconds = int(epoch) if epoch.isdigit() else int(time.time())
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def parse_provenance(data: object, where: Path | str) -> Provenance:
    """The model of a provenance's parsed JSON; one that does not fit is an ``ArtifactError`` (one line)."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: not a JSON object; rebuild the artifact")
    try:
        return Provenance.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        at = ".".join(str(p) for p in first["loc"]) or "(top)"
        msg = first["msg"].removeprefix("Value error, ")
        raise ArtifactError(f"{where}: {at}: {msg}; rebuild the artifact") from None
