"""``output_status``: what an output folder holds, read from that folder alone.

A build's completion markers are its stage manifests (``OUT/.hybrid-build/<stage>.json``), keyed
by content rather than by existence: a stage is ``done`` only when its manifest's key is the key
the stage would have now (tool version, source fingerprint, its recipe section, the keys of the
stages it reads) and its outputs are intact. The source and the recipe that key hashes are found
where the build recorded them (``core.source_identity``'s location file, ``core.artifact.RUN_RECIPE``);
a source that is not reachable here leaves the keys unchecked (``unknown``), never guessed.
Reports say whether they were made for the build there now (``core.artifact.report_state``), and
the build's validation its outcome (``core.artifact.validation_outcome``: passed, failed, could not
run, missing or stale, with the reason and the time). The artifact's files are checked against the
provenance (``core.integrity``); a file that differs makes the stage that wrote it, and those that
read its result, stale, naming the file. Nothing is written but the digest caches in the work folder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_build.core import __version__
from hybrid_build.core.artifact import (
    PROVENANCE,
    RECIPE,
    REPORTS,
    RUN_RECIPE,
    WORK_DIR,
    artifact_path,
    provenance_sha256,
    read_provenance,
    read_recipe_data,
    report_state,
    unexpected_files,
)
from hybrid_build.core.bound import BoundArtifact, open_artifact, trusted_keys, unfinished
from hybrid_build.core.bounded_read import SMALL_JSON, InputRefused, read_json
from hybrid_build.core.errors import ArtifactError, HybridBuildError, UserError
from hybrid_build.core.manifest import StageManifest
from hybrid_build.core.names import name_problem
from hybrid_build.core.progress import ProgressFactory, null_progress

if TYPE_CHECKING:
    from hybrid_build.core.provenance import Provenance
from hybrid_build.core.source_identity import (
    DIGEST_CACHE,
    LOCATION_FILE,
    SourceDigests,
    SourceRecord,
    mismatch,
    read_record,
)

from .context import BuildContext
from .stages import STAGES, load_stage


@dataclass
class SourceStatus:
    state: str  # unchanged | changed | unreachable | unchecked (a Hub source) | unrecorded
    where: str | None  # the folder or Hub id the build read
    reason: str = ""


@dataclass
class StageStatus:
    stage: str
    state: str  # done | stale | missing | unknown (its key cannot be recomputed here)
    reason: str = ""
    finished_at: float | None = None


@dataclass
class ReportStatus:
    report: str
    state: str  # current | stale | unknown | missing
    reason: str
    files: list[str]
    command: str


@dataclass
class OutputStatus:
    output: str
    built: bool  # it holds a provenance: record finished
    provenance_sha256: str | None
    recipe: str | None
    source: SourceStatus
    stages: list[StageStatus]
    reports: list[ReportStatus]
    unexpected: list[str] = field(default_factory=list)  # files validate and publish would refuse
    # the files against the provenance (core.integrity.Integrity.to_json; None: not built)
    artifact: dict | None = None
    # the build's validation: state (passed, failed, could not run, missing, stale), reason, finished_at, report
    validation: dict = field(default_factory=dict)
    # what each profile's `serve` went through (serve.launch.serve_record): state, restarts, faults
    serving: list[dict] = field(default_factory=list)
    in_progress: str | None = None  # a build being written or stopped part-way (core.bound.unfinished)
    signature: dict | None = None  # core.signing.SignatureCheck.to_json (None: not built)
    # what this machine vouches for (core.local_trust): built_here, validated_here, and the trust records
    # the folder carries that it ignores (foreign); None: not built
    trust: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def output_status(out: Path, progress: ProgressFactory = null_progress) -> OutputStatus:
    """The state of every stage and report of the output folder ``out``, and of its source."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out}: no such folder")
    in_progress = unfinished(out)
    bound = None
    if (out / PROVENANCE).is_file() and not in_progress:
        # the artifact opened and checked once (core.bound): files and reports, links, reference, signature;
        # everything status says of the artifact's own files is asked of it
        bound = open_artifact(out, trusted=trusted_keys(None), progress=progress)
        prov = bound.provenance
    else:  # a build being written, stopped, or not recorded yet: its stages are what there is to show
        prov = read_provenance(out, missing_ok=True)
    if prov is None and not (out / WORK_DIR).is_dir():
        raise UserError(f"{out}: not a hybrid-build output (no {PROVENANCE}, no {WORK_DIR}/): nothing was built here")
    read = {name: StageManifest.read(out / WORK_DIR / f"{name}.json") for name in STAGES}
    manifests = {name: m for name, (m, _) in read.items()}
    unread = {name: why for name, (m, why) in read.items() if m is None}
    # a source path the folder records is read only where this machine built here (the build, or a stage)
    here = bool(bound and bound.built_here) or any(m is not None for m in manifests.values())
    record = _recorded_source(out, prov)
    source, digests = _check_source(out, record, progress, here)
    recipe_data, recipe_file = _recipe(out, bound)
    ctx, why_unchecked = _context(out, record, source, digests, recipe_file)
    found = bound.integrity if bound else None
    from .runner import stage_changes

    changed = stage_changes(found.by_file, prov, manifests) if found else {}
    known = {**bound.verified(), PROVENANCE: bound.build} if bound else None
    stages = [_stage_state(out, name, manifests, source, record, ctx, why_unchecked, changed, known, bound, unread)
              for name in STAGES]
    reports = [_report_state(out, r, prov is not None, bound) for r in REPORTS.values()]
    artifact = found.to_json() if found else None
    if bound is not None and not bound.intact:  # a link, a reference or a signature that is not sound
        artifact.update(intact=False, problem=bound.problem, problems=bound.problems)
    build = bound.build if bound else provenance_sha256(out)
    return OutputStatus(str(out), prov is not None and not in_progress, build,
                        (recipe_data or {}).get("name"), source, stages, reports,
                        (found.unexpected if found else unexpected_files(out, prov) if prov else []), artifact,
                        _validation(out, prov is not None, bound), serving=_serving(out), in_progress=in_progress,
                        signature=bound.signature.to_json() if bound else None,
                        trust={"built_here": bound.built_here, "validated_here": bound.validated_here,
                               "foreign": bound.foreign, "line": bound.trust_line()} if bound else None)


def _serving(out: Path) -> list[dict]:
    """The serve records, each with ``alive``: whether the serve that wrote it still runs (a record
    left "ready" by a serve that was killed says so), and ``orphan_engine``: the pid of an engine that
    outlived its serve (the pid and its start time recorded, so another process that got the pid later
    is not taken for it)."""
    from hybrid_build.serve.launch.serve_record import alive, read_records

    records = read_records(out)
    for r in records:
        r["alive"] = r.get("state") != "stopped" and alive(r.get("serve_pid"), r.get("serve_start"))
        engine = r.get("engine_pid")
        r["orphan_engine"] = engine if not r["alive"] and alive(engine, r.get("engine_start")) else None
    return records


def _validation(out: Path, built: bool, bound: BoundArtifact | None) -> dict:
    """The build's validation outcome; a report of files that differ from the provenance now says
    nothing about them, whatever it says."""
    if not built or bound is None:
        return {"state": "missing", "reason": "nothing is built here yet", "finished_at": None, "report": None}
    data = bound.validation.to_json()
    if not bound.intact and data["state"] == "passed":
        data.update(state="stale", reason=f"it passed on files that have changed since: {bound.problem}")
    return data


# ------------------------------------------------------------------------------------ the source


def _recorded_source(out: Path, prov: Provenance | None) -> SourceRecord | None:
    """The source as the provenance records it, else (a build that has not reached record) as
    the work folder's location file does."""
    record = read_record(out, prov) if prov else None
    if record is not None:
        return record
    try:
        loc = read_json(out / WORK_DIR / LOCATION_FILE, LOCATION_FILE, SMALL_JSON)
    except (OSError, InputRefused):
        return None
    if not isinstance(loc, dict) or not (loc.get("path") or loc.get("in_artifact")):
        return None
    if name_problem(loc.get("in_artifact")):
        loc["in_artifact"] = None  # a place inside the folder, or none
        if not loc.get("path"):
            return None
    name = Path(loc.get("path") or loc["in_artifact"]).name
    return SourceRecord("local", name, None, loc.get("fingerprint"), {}, loc.get("path"), loc.get("in_artifact"))


def _check_source(out: Path, record: SourceRecord | None, progress: ProgressFactory,
                  here: bool = True) -> tuple[SourceStatus, SourceDigests | None]:
    """The recorded source checked against its bytes. A folder from elsewhere (``here`` False) names paths of
    another machine: status reads none of them, and a place inside the folder only where it stays inside."""
    if record is None:
        return SourceStatus("unrecorded", None, "no stage has recorded its source yet"), None
    candidates = []
    if record.in_artifact:
        try:
            candidates.append(artifact_path(out, record.in_artifact))
        except ArtifactError:
            pass
    if record.path and here:
        candidates.append(Path(record.path))
    root = next((c for c in candidates if (c / "config.json").is_file()), None)
    if root is None and record.path and not here and record.kind != "hub":
        return SourceStatus("unchecked", record.describe(), "recorded by the machine that built this folder: status "
                            "reads no path a folder from elsewhere names (pass the source to `run --dry-run` to "
                            "check it)"), None
    if root is None:
        if record.kind == "hub":
            return SourceStatus("unchecked", record.describe(),
                                "a Hub source: status does not download it (pass it to `run --dry-run` to check)"), None
        return SourceStatus("unreachable", record.describe(), "the folder is not there any more"), None
    digests = SourceDigests(root, out / WORK_DIR / DIGEST_CACHE)
    where = str(root.resolve())
    why = mismatch(record, digests.result(progress)) if record.files else None
    if why is None and record.fingerprint and digests.fingerprint() != record.fingerprint:
        why = "its content differs from what the build read"
    if why:
        return SourceStatus("changed", where, why), digests
    return SourceStatus("unchanged", where, "its content is what the build read"), digests


# ------------------------------------------------------------------------------------ the stages


def _recipe(out: Path, bound: BoundArtifact | None) -> tuple[dict | None, Path | None]:
    """The recipe the stage keys hash: the last run's (in the work folder), else the artifact's copy
    (older builds; the bound artifact's where there is one)."""
    data = read_recipe_data(out, missing_ok=True, which=RUN_RECIPE)
    if isinstance(data, dict):
        return data, out / RUN_RECIPE
    data = bound.recipe_data() if bound is not None else read_recipe_data(out, missing_ok=True, which=RECIPE)
    return (data, out / RECIPE) if isinstance(data, dict) else (None, None)


def _context(out: Path, record: SourceRecord | None, source: SourceStatus, digests: SourceDigests | None,
             recipe_file: Path | None) -> tuple[BuildContext | None, str]:
    """A build context to recompute stage keys with, or None and why the keys cannot be checked."""
    if source.state != "unchanged":
        return None, f"source {source.state}" + (f": {source.reason}" if source.reason else "")
    if recipe_file is None:
        return None, f"no recorded recipe ({RUN_RECIPE} or {RECIPE})"
    from .build import prepare

    try:
        ctx = prepare(digests.root, out, str(recipe_file), force=True, in_artifact=record.in_artifact)
    except HybridBuildError as e:
        return None, f"the recorded source and recipe do not plan a build ({str(e).splitlines()[0]})"
    ctx._digests = digests  # hashed once for the source check
    return ctx, ""


def _stage_state(out: Path, name: str, manifests: dict[str, StageManifest | None], source: SourceStatus,
                 record: SourceRecord | None, ctx: BuildContext | None, why_unchecked: str,
                 changed: dict[str, str], known: dict[str, str] | None = None,
                 bound: BoundArtifact | None = None, unread: dict[str, str] | None = None) -> StageStatus:
    m = manifests[name]
    if m is None:
        why = (unread or {}).get(name, "no manifest")
        return StageStatus(name, "missing", f"it has not finished in this folder ({why})")
    why = _why_stale(out, m, manifests, source, record, ctx, changed, known, bound)
    if why:
        return StageStatus(name, "stale", why, m.finished_at)
    if ctx is None:
        return StageStatus(name, "unknown", f"its key cannot be recomputed: {why_unchecked}", m.finished_at)
    return StageStatus(name, "done", "its key and outputs match", m.finished_at)


def _why_stale(out: Path, m: StageManifest, manifests: dict[str, StageManifest | None],
               source: SourceStatus, record: SourceRecord | None, ctx: BuildContext | None,
               changed: dict[str, str], known: dict[str, str] | None = None,
               bound: BoundArtifact | None = None) -> str | None:
    """Why the stage's result no longer holds, the most basic cause first; None if none is seen.
    ``known``: the sha256 of the files the bound artifact found intact (not hashed again), the
    provenance's by the build's name; ``bound``: the artifact a stage's ``current`` asks."""
    tool = m.inputs.get("tool")
    if tool != __version__:
        return f"made by hybrid-build {tool}, this is {__version__}"
    if source.state == "changed":
        return f"the source changed: {source.reason}"
    if record is not None and record.fingerprint and m.inputs.get("source") != record.fingerprint:
        return "made from another source than the one recorded"
    for up, key in (m.inputs.get("reads") or {}).items():
        got = manifests.get(up)
        if got is None:
            return f"the {up} result it read is gone"
        if got.key != key:
            return f"{up} ran again since, with other inputs"
    problem = m.output_problem(out, known) or changed.get(m.stage)
    if problem:
        return problem
    current = load_stage(m.stage).current
    why = current(out, bound) if current else None  # a report judged by its state (validate), not its bytes
    if why:
        return why
    if ctx is not None:
        from .runner import stage_key

        if stage_key(ctx, m.stage) != m.key:
            if load_stage(m.stage).inputs(ctx) != m.inputs.get("inputs"):
                return "its recipe section differs from the recorded recipe"
            return "its inputs differ from the recorded ones"
    return None


# ------------------------------------------------------------------------------------ the reports


def _report_state(out: Path, report, built: bool, bound: BoundArtifact | None = None) -> ReportStatus:
    present = [f for f in report.files if (out / f).is_file()]
    if not present:
        return ReportStatus(report.kind, "missing", f"`{report.command}` writes it", [], report.command)
    if not built:
        return ReportStatus(report.kind, "stale", "there is no build here for it to describe", present,
                            report.command)
    state, why = bound.report_state(report) if bound else report_state(out, report)
    changed = [p for p in (bound.problems if bound else []) if any(p.startswith(f) for f in report.files)]
    if changed and state != "stale":  # edited since the command that wrote it sealed it
        return ReportStatus(report.kind, "changed", changed[0], present, report.command)
    return ReportStatus(report.kind, state, why, present, report.command)
