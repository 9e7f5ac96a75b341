"""The artifact folder's layout: the one place that names its files and says what each one is.

An artifact (the folder ``hybrid-build run`` writes) holds four kinds of file:

- **build outputs**: the checkpoint (shards, index, ``config.json``, ``quantization_config.json``,
  the source's other files) and the resolved recipe copy. ``provenance.json`` lists each with its
  sha256; a stage that writes into the artifact adds a build output and nothing more.
- **the provenance** (``META_DIR/provenance.json``) itself, written after the outputs it hashes.
- **reports** (``REPORTS``), written after the build by a named command (validate, eval, bench).
  They cannot be in the provenance, so they tie themselves to the build by its sha256
  (``artifact_identity``); a new report is one entry in ``REPORTS``. Two kinds of validate record
  sit beside them and are never uploaded: ``validation-last.*`` (a run that did not pass, kept
  apart so that it never replaces the build's passing report) and ``validation-texts-<hash>.*``
  (``validate --texts``: the user's experiment, named by the texts' hash).
- **the work folder** (``WORK_DIR``: stage manifests, intermediates, where the source is) and any
  other dot folder (``hf download`` leaves ``.cache``), plus half-written temporaries: never part
  of the artifact.

Any other file was added after the build: validate fails it and publish refuses it. The functions
here read the provenance and the recipe copy for every command, so each says the same thing when
they are missing or broken.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .bounded_read import SMALL_JSON, InputRefused, parse_json, parse_yaml, read_bytes, read_json, read_text
from .errors import ArtifactError, UserError
from .manifest import build_digest, sha256_json
from .names import name_problem
from .safetensors_io import INDEX_NAME, TMP_SUFFIX

if TYPE_CHECKING:
    from .provenance import Provenance

META_DIR = "hybrid_build"  # the build's own records, inside the artifact (published)
WORK_DIR = ".hybrid-build"  # stage manifests and intermediates (never published)
PROVENANCE = f"{META_DIR}/provenance.json"
RECIPE = f"{META_DIR}/recipe.yaml"  # the resolved recipe the build used
CONFIG = "config.json"
QUANT_CONFIG = "quantization_config.json"
INDEX = INDEX_NAME  # written last: a folder with an index is a complete build
CARD = "README.md"  # the source's card, copied; publish replaces it with a generated one
ARTIFACT_DIGESTS = f"{WORK_DIR}/artifact-sha256.json"  # sha256 of the artifact's files, by stat
DEMO_SOURCE = f"{WORK_DIR}/demo-source"  # `run` without SOURCE builds the demo checkpoint here
RUN_RECIPE = f"{WORK_DIR}/recipe.yaml"  # the resolved recipe of the last run: `status` keys stages with it
SERVE_RECORD = f"{WORK_DIR}/serve-{{profile}}.json"  # what a `serve` of a profile went through (status reads it)
# written by `run` before its first write into the output, removed when the build is complete: a folder
# holding it is a build in progress or one that stopped, never an artifact nor a source checkpoint
IN_PROGRESS = f"{WORK_DIR}/in-progress.json"
RUN_LOCK = f"{WORK_DIR}/run.lock"  # `run` holds an exclusive flock on it while it writes
# where hybrid-build once recorded a passing local `validate` inside the folder: a download could carry
# one, so the record now lives in the user's state folder (core.local_trust) and this file is ignored
VALIDATED_HERE = f"{WORK_DIR}/validated-here.json"
SIGNATURE = "model.sig"  # OpenSSF Model Signing's signature (core.signing), at the root: written by publish


@dataclass(frozen=True)
class Report:
    """A report written into the artifact after the build by ``command``. ``names`` are its files in
    ``META_DIR`` (the first is the JSON one); ``build_field`` is where that JSON records the
    provenance sha256 of the build it describes (None: the report names no build)."""

    kind: str
    names: tuple[str, ...]
    command: str
    build_field: tuple[str, ...] | None = ("artifact", "provenance_sha256")

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f"{META_DIR}/{n}" for n in self.names)

    @property
    def main(self) -> str:
        return self.files[0]

    def named(self, suffix: str) -> str:
        """Its file ending in ``suffix`` (``.md``)."""
        return next(f for f in self.files if f.endswith(suffix))

    def path(self, artifact: Path) -> Path:
        return Path(artifact) / self.main

    def recorded_build(self, data: dict) -> str | None:
        for key in self.build_field or ():
            data = data.get(key) if isinstance(data, dict) else None
        return data if isinstance(data, str) else None


REPORTS: dict[str, Report] = {r.kind: r for r in (
    Report("validation", ("validation.json", "validation.md", "validation.png"), "hybrid-build validate",
           ("provenance_sha256",)),
    Report("eval", ("eval.json", "eval.md"), "hybrid-build eval"),
    Report("bench", ("bench.json",), "hybrid-build bench URL --out ARTIFACT/hybrid_build/bench.json", None),
    # the hybrid's own top-k log-probabilities on the validate texts (validate.reference): computed
    # from the build's bytes after the build, so a report, tied to the build by provenance
    Report("reference", ("reference.json", "reference.safetensors"), "hybrid-build validate",
           ("provenance_sha256",)),
    # the model card `publish` would upload as README.md, rendered for the folder by `run` (Markdown:
    # it names no build; it is never uploaded under this name)
    Report("card", ("card.md",), "hybrid-build run", None),
)}
REPORT_FILES = tuple(f for r in REPORTS.values() for f in r.files)
# a validate run that did not pass while the build's passing report stands: kept beside it, never
# in its place (status, serve and publish read it as the latest outcome)
VALIDATION_LAST = Report("validation-last", ("validation-last.json", "validation-last.md", "validation-last.png"),
                         "hybrid-build validate", ("provenance_sha256",))
TEXTS_REPORT_PREFIX = "validation-texts-"  # + the first 16 hex digits of the texts' sha256
_TEXTS_REPORT = re.compile(rf"^{META_DIR}/{TEXTS_REPORT_PREFIX}[0-9a-f]{{16}}\.(json|md|png)$")


def texts_report(texts_sha256: str) -> Report:
    """The report of ``validate --texts`` on texts whose sha256 is ``texts_sha256``."""
    stem = TEXTS_REPORT_PREFIX + texts_sha256[:16]
    return Report("validation-texts", (f"{stem}.json", f"{stem}.md", f"{stem}.png"), "hybrid-build validate --texts",
                  ("provenance_sha256",))


def is_validate_record(rel: str) -> bool:
    """A validate record that is not the build's report: a run that did not pass, or a run on the
    user's texts. Part of the folder, never uploaded."""
    return rel in VALIDATION_LAST.files or bool(_TEXTS_REPORT.match(rel))


# ------------------------------------------------------------------------------------ names


def artifact_path(artifact: Path, rel: str) -> Path:
    """The one place a name of the artifact becomes a path: ``rel`` checked (``name_problem``), and the
    path it gives resolved (links followed) and checked to stay inside ``artifact``; otherwise an
    ``ArtifactError`` naming the entry."""
    why = name_problem(rel)
    if why:
        raise ArtifactError(f"{artifact}: {why}: not a name inside the artifact")
    path = Path(artifact) / rel
    base, real = Path(artifact).resolve(), path.resolve()
    if real != base and base not in real.parents:
        raise ArtifactError(f"{artifact}: {rel} leads outside the artifact (to {real})")
    return path


# ------------------------------------------------------------------------------------ what a file is


def rel_name(artifact: Path, path: Path) -> str:
    """``path`` as the provenance names it: relative to the artifact, with ``/``."""
    return Path(path).relative_to(artifact).as_posix()


def is_ignored(rel: str) -> bool:
    """In the work folder or another dot folder, or half-written: not part of the artifact."""
    return any(p.startswith(".") for p in rel.split("/")) or rel.endswith(TMP_SUFFIX)


def is_report(rel: str) -> bool:
    return rel in REPORT_FILES or is_validate_record(rel)


def is_build_output(rel: str) -> bool:
    """A file the provenance hashes: everything but itself, the reports, the signature (which covers
    them all) and the ignored ones."""
    return not (is_ignored(rel) or is_report(rel) or rel in (PROVENANCE, SIGNATURE))


def present_files(artifact: Path) -> list[str]:
    """Every file of the artifact (relative names, sorted), the ignored ones left out."""
    artifact = Path(artifact)
    out = []
    for dirpath, dirnames, filenames in os.walk(artifact):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # the work folder can be large
        for name in filenames:
            rel = rel_name(artifact, Path(dirpath) / name)
            if not is_ignored(rel):
                out.append(rel)
    return sorted(out)


def build_outputs(artifact: Path) -> list[str]:
    """The files the provenance of a build written into ``artifact`` now lists."""
    return [rel for rel in present_files(artifact) if is_build_output(rel)]


def unexpected_files(artifact: Path, provenance: Provenance) -> list[str]:
    """Files that are neither listed in ``provenance`` nor the provenance itself nor a known report."""
    listed = provenance.files
    return [rel for rel in present_files(artifact) if is_build_output(rel) and rel not in listed]


# ------------------------------------------------------------------------------------ reading


def read_provenance(artifact: Path, *, missing_ok: bool = False) -> Provenance | None:
    """The artifact's provenance manifest as the typed model (``core.provenance.Provenance``). A
    folder that is not there, or holds none, is a user error (exit 2: wrong folder, or a build that
    has not reached ``record``); with ``missing_ok`` that returns None instead. One that does not
    parse or fit is an ``ArtifactError``."""
    artifact = Path(artifact)
    if not artifact.is_dir():
        if missing_ok:
            return None
        raise UserError(f"{artifact}: no such artifact folder")
    raw = provenance_bytes(artifact)
    if raw is None:
        if missing_ok:
            return None
        raise UserError(f"{artifact}: no {PROVENANCE}: not an artifact built by `hybrid-build run`, or a build "
                        "that has not finished (`hybrid-build status` says which stage is missing)")
    return parse_provenance_bytes(raw, artifact)


def provenance_bytes(artifact: Path) -> bytes | None:
    """The provenance file's bytes, None when there is none; one that cannot be read is an
    ``ArtifactError`` (a FIFO in its place, or one over the cap, is refused: never waited on, never
    read whole)."""
    path = Path(artifact) / PROVENANCE
    if not os.path.lexists(path):
        return None
    try:
        return read_bytes(path, str(path), error=ArtifactError)
    except ArtifactError as e:
        raise ArtifactError(f"{e}; rebuild the artifact") from None


def parse_provenance_bytes(raw: bytes, artifact: Path) -> Provenance:
    """``raw`` (the provenance file's bytes) as the typed model, nested at most ``MAX_DEPTH``; an
    ``ArtifactError`` naming the file and the entry when it does not parse or fit (a name outside the
    artifact included)."""
    from .provenance import parse_provenance  # pydantic: here, not at --help

    path = Path(artifact) / PROVENANCE
    try:
        data = parse_json(raw, str(path), error=ArtifactError)
    except ArtifactError as e:
        raise ArtifactError(f"{e}; rebuild the artifact") from None
    return parse_provenance(data, path)


def read_recipe_data(artifact: Path, *, missing_ok: bool = False, which: str = RECIPE) -> dict | None:
    """The artifact's recipe copy (or ``which``: ``RUN_RECIPE``) as a YAML mapping
    (``recipes.schema.parse_recipe`` makes it a ``Recipe``; core does not know the schema). None
    when absent and ``missing_ok``."""
    import yaml

    path = Path(artifact) / which
    if not os.path.lexists(path):
        if missing_ok:
            return None
        raise ArtifactError(f"{artifact}: no {which}: the build did not get that far, or the file was "
                            "removed; rebuild it")
    try:
        return parse_yaml(read_text(path, str(path), error=ArtifactError), str(path))
    except yaml.YAMLError as e:
        raise ArtifactError(f"{path}: unreadable ({str(e).splitlines()[0]})") from None


# ------------------------------------------------------------------------------------ identity


def provenance_sha256(artifact: Path) -> str | None:
    """The sha256 of the provenance file as ``record`` wrote it: it names one build of the folder (None:
    no build). The ``reports`` section that ``seal_reports`` adds later is left out, so that sealing a
    report never changes the build's name that the reports record."""
    try:
        raw = read_bytes(Path(artifact) / PROVENANCE, PROVENANCE)
    except (OSError, InputRefused):
        return None
    return build_digest(raw)


def sealed_files(artifact: Path) -> list[str]:
    """The report files present in ``artifact`` (every file a command writes after the build), the
    card aside: it is rendered from them, and ``publish`` renders it again rather than read it."""
    return [rel for rel in present_files(artifact) if is_report(rel) and rel not in REPORTS["card"].files]


def seal_report_at(path: Path) -> None:
    """After a report was written at ``path``: when that is a report's place in an artifact
    (``ARTIFACT/hybrid_build/<report>``), seal the artifact's reports (``seal_reports``)."""
    path = Path(path).absolute()
    artifact = path.parent.parent
    if path.parent.name == META_DIR and is_report(rel_name(artifact, path)) and (artifact / PROVENANCE).is_file():
        seal_reports(artifact)


def seal_reports(artifact: Path) -> None:
    """Record every report now in ``artifact`` (size and sha256) in the provenance's ``reports``
    section, so that an edit to any of them is refused like an edit to a shard. Each command that
    writes a report calls it once its files are in place. A report that is a symlink is refused."""
    from .provenance import FileEntry
    from .safetensors_io import write_text_atomic

    artifact = Path(artifact)
    prov = read_provenance(artifact, missing_ok=True)
    if prov is None:
        return
    reports = {}
    for rel in sealed_files(artifact):
        path = artifact / rel
        if path.is_symlink():
            raise ArtifactError(f"{artifact}: {rel} is a symbolic link: a report is a regular file; remove it")
        data = read_bytes(path, rel)
        reports[rel] = FileEntry(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    built = provenance_sha256(artifact)
    prov.reports = reports or None
    text = prov.to_text()
    if build_digest(text.encode()) != built:  # the build's name never moves
        raise ArtifactError(f"{artifact / PROVENANCE}: its layout is not the one `record` writes; rebuild it")
    write_text_atomic(artifact / PROVENANCE, text)


def artifact_identity(artifact: Path) -> dict:
    """What a report records about the build it describes: the folder's name and the provenance
    sha256, which ``report_state`` (and the model card) compare with the build there now."""
    return {"name": Path(artifact).resolve().name, "provenance_sha256": provenance_sha256(artifact)}


def build_fingerprint(provenance: Provenance) -> str:
    """The build's identity by content (source fingerprint and every output's sha256), the same on
    two machines that hold the same bytes whatever else their provenance files say."""
    return sha256_json({"source": provenance.source.get("fingerprint"),
                        "files": {f: i.sha256 for f, i in sorted(provenance.files.items())}})


_UNSET = object()


def report_state(artifact: Path, report: Report, *, build=_UNSET, data=_UNSET,
                 sealed=_UNSET) -> tuple[str, str]:
    """Whether ``report`` in ``artifact`` belongs to the build there now: ``current``, ``stale``,
    ``unknown`` (it names no build) or ``missing``, and why. ``build`` (the provenance's sha256),
    ``data`` (the report's parsed JSON, or an ``Exception`` it raised) and ``sealed`` (the
    provenance) where the caller has them already (``core.bound.BoundArtifact.report_state``)."""
    path = report.path(artifact)
    if not path.is_file():
        return "missing", f"no {report.main} (written by `{report.command}`)"
    recorded = None
    if report.build_field is not None:
        if data is _UNSET:
            try:
                data = read_json(path, report.main)
            except (OSError, InputRefused) as e:
                data = e
        if isinstance(data, Exception):
            return "stale", f"it is unreadable ({type(data).__name__})"
        recorded = report.recorded_build(data) if isinstance(data, dict) else None
    actual = provenance_sha256(artifact) if build is _UNSET else build
    if recorded:
        if recorded == actual:
            return "current", "it was made for this build (provenance matches)"
        return "stale", "it was made for an earlier build of this folder (provenance differs)"
    prov = Path(artifact) / PROVENANCE
    # a report from before reports recorded the build: written before the provenance is older (once
    # sealed in the provenance, whose file then is newer, it is this build's: a rebuild drops the seal)
    sealed = read_provenance(artifact, missing_ok=True) if sealed is _UNSET else sealed
    if sealed is not None and report.main in (sealed.reports or {}):
        return "unknown", "it names no build"
    if prov.is_file() and path.stat().st_mtime < prov.stat().st_mtime:
        return "stale", f"it is older than {PROVENANCE}"
    return "unknown", "it names no build"


# ------------------------------------------------------------------------------------ validation


@dataclass(frozen=True)
class ValidationOutcome:
    """The build's validation as status, serve and publish read it: ``passed``, ``failed``, ``could
    not run``, ``missing`` or ``stale`` (made for another build), why, when the run ended (ISO 8601
    UTC) and the record it comes from (relative to the artifact)."""

    state: str
    reason: str
    finished_at: str | None = None
    report: str | None = None

    @property
    def passed(self) -> bool:
        return self.state == "passed"

    def to_json(self) -> dict:
        return {"state": self.state, "reason": self.reason, "finished_at": self.finished_at, "report": self.report}




def _record(artifact: Path, rel: str) -> dict | None:
    try:
        data = read_json(Path(artifact) / rel, rel, SMALL_JSON)
    except (OSError, InputRefused):
        return None
    return data if isinstance(data, dict) else None


def _finished_at(artifact: Path, rel: str, data: dict) -> str | None:
    when = data.get("finished_at")
    if isinstance(when, str):
        return when
    try:  # a report from before reports recorded the time: its file's
        import time

        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((Path(artifact) / rel).stat().st_mtime))
    except OSError:
        return None


def _first_failure(data: dict) -> str:
    failures = [f for f in data.get("failures") or [] if isinstance(f, str)]
    if not failures:
        return "the report says passed: false"
    return failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")


def validation_outcome(artifact: Path, *, build=_UNSET, read=None) -> ValidationOutcome:
    """The latest validation of the build in ``artifact``: a failed run kept beside a passing report
    (``VALIDATION_LAST``) of the same build counts first; then the build's report. ``build`` (the
    provenance's sha256) and ``read`` (name -> parsed JSON, or the exception it raised, or None:
    ``core.bound.BoundArtifact.read_json``) where the caller has them."""
    artifact = Path(artifact)
    built = provenance_sha256(artifact) if build is _UNSET else build

    def record(rel: str) -> dict | None:
        if read is None:
            return _record(artifact, rel)
        data = read(rel)
        return data if isinstance(data, dict) else None

    last = record(VALIDATION_LAST.main)
    if last and built and last.get("provenance_sha256") == built and last.get("outcome") == "failed":
        return ValidationOutcome("failed", _first_failure(last), _finished_at(artifact, VALIDATION_LAST.main, last),
                                 VALIDATION_LAST.main)
    report = REPORTS["validation"]
    if read is None:
        state, why = report_state(artifact, report)
    else:
        got = read(report.main)
        state, why = report_state(artifact, report, build=built,
                                  data=got if got is not None else ValueError("not there"))
    if state == "missing":
        return ValidationOutcome("missing", f"no {report.main}: run `hybrid-build validate`")
    data = record(report.main)
    if data is None:
        return ValidationOutcome("stale", f"{report.main} is unreadable: run `hybrid-build validate` again",
                                 None, report.main)
    when = _finished_at(artifact, report.main, data)
    if state == "stale":
        return ValidationOutcome("stale", f"{report.main}: {why}", when, report.main)
    outcome = data.get("outcome") or ("passed" if data.get("passed") is True else "failed")
    if outcome == "passed" and data.get("passed") is True:
        return ValidationOutcome("passed", "every check passed", when, report.main)
    if outcome == "could not run":
        undone = [f"{c.get('name')}: {c.get('detail')}" for c in data.get("checks") or []
                  if isinstance(c, dict) and c.get("state") == "could not run"]
        return ValidationOutcome("could not run", "; ".join(undone) or "a check could not run here", when, report.main)
    return ValidationOutcome("failed", _first_failure(data), when, report.main)
