"""The bound artifact: the folder opened and checked once, for every command that reads or ships it.

One digest binds it. The provenance lists every build output and, in its ``reports`` section
(``core.artifact.seal_reports``), every report written since (validation, reference, eval, bench,
card); the validation report records the provenance's name (``provenance_sha256``) and the digests
of the reference it rests on; the card is generated from the report. ``open_artifact`` checks all of
it in one pass and returns a ``BoundArtifact`` that ``status``, ``serve``, ``publish`` and ``verify``
ask, instead of each reading the folder piece by piece:

- the folder is a finished build: no ``IN_PROGRESS`` marker (``run`` writes it before its first
  write and removes it when the build is complete), a provenance;
- it holds regular files only: a symbolic link anywhere in it is a problem naming it (never
  followed, never uploaded, never served);
- every file the provenance lists, reports included, has its recorded size and sha256 and nothing
  else is there (``core.integrity``, through its hash cache);
- the validation outcome (``core.artifact.validation_outcome``), and whether the report agrees with
  itself (a report that says passed while it lists failures is a problem);
- the reference: the digests the report records are the files' digests, and its values are finite
  log-probabilities (<= 0) and token ids (>= 0), or it is refused whole;
- the signature (``core.signing``) where one is there: who signed it, every file matches;
- every name the provenance, the index and the signature list is a name inside the folder
  (``core.names``), and every name becomes a path in one place (``BoundArtifact.path``), resolved and
  checked to stay inside;
- whether this machine built or validated this build: asked of the user's state folder
  (``core.local_trust``), never of the folder, whose own claims are named (``foreign``) and ignored.

Each problem is one line naming the file; ``require`` raises the first. It is also the one reader of
a finished artifact: ``publish``, the card, ``status`` and ``serve`` ask it for the parts they need
(the config, the recipe copy, the reports, the source's card, the headers) instead of opening files.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .artifact import (
    CARD,
    CONFIG,
    IN_PROGRESS,
    INDEX,
    META_DIR,
    PROVENANCE,
    REPORTS,
    VALIDATED_HERE,
    WORK_DIR,
    Report,
    ValidationOutcome,
    artifact_path,
    is_validate_record,
    parse_provenance_bytes,
    provenance_bytes,
    provenance_sha256,
    read_provenance,
    read_recipe_data,
    report_state,
    validation_outcome,
)
from .bounded_read import SMALL_JSON, InputRefused, open_regular, read_json, read_text
from .errors import ArtifactError, UserError
from .integrity import Integrity, check_artifact, first_problem
from .manifest import build_digest
from .names import name_problem
from .progress import ProgressFactory, null_progress
from .provenance import Provenance
from .signing import SIGNATURE, SignatureCheck, check_signature

REFERENCE = REPORTS["reference"]


@dataclass
class BoundArtifact:
    """What ``open_artifact`` found: the provenance, the files' check, the validation, the
    signature, and every problem (one line each, naming the file; the first leads)."""

    root: Path
    provenance: Provenance
    build: str  # the provenance's sha256 (core.artifact.provenance_sha256): the build's name
    integrity: Integrity
    validation: ValidationOutcome
    signature: SignatureCheck
    problems: list[str] = field(default_factory=list)
    built_here: bool = False  # this machine built these bytes (core.local_trust, never the folder's word)
    validated_here: bool = False  # a `validate` on this machine passed for this build (core.local_trust)
    foreign: list[str] = field(default_factory=list)  # trust claims the folder carries, ignored (foreign_claims)
    provenance_digest: str = ""  # the sha256 of the provenance file's bytes (reports sealed in it included)
    _json: dict = field(default_factory=dict, repr=False)  # the JSON files read so far, by relative path
    _parts: dict = field(default_factory=dict, repr=False)  # the other parts asked for so far, by name

    @property
    def intact(self) -> bool:
        return not self.problems

    @property
    def problem(self) -> str | None:
        return first_problem(self.problems)

    def verified(self) -> dict[str, str]:
        """name -> sha256 of every file the provenance lists (reports included) whose bytes were found
        to be the recorded ones when the artifact was opened: a caller needs not hash them again."""
        listed = {**self.provenance.files, **(self.provenance.reports or {})}
        return {rel: e.sha256 for rel, e in listed.items() if rel not in self.integrity.by_file}

    def read_json(self, rel: str) -> dict | list | Exception | None:
        """A JSON file of the artifact (a report, ``config.json``, the index), parsed once and kept: None
        when it is not there, the exception when it does not parse or its name leads outside the
        artifact. Its bytes were checked by ``open_artifact``."""
        if rel not in self._json:
            try:  # a name inside the artifact; a regular file, capped, nested at most MAX_DEPTH (core.bounded_read)
                path = self.path(rel)
                self._json[rel] = read_json(path, rel) if path.exists() else None
            except (OSError, InputRefused, ArtifactError) as e:
                self._json[rel] = e
        return self._json[rel]

    def text(self, rel: str) -> str | None:
        """A text file of the artifact (the source's card), or None when it is absent or unreadable."""
        try:
            path = self.path(rel)
            return read_text(path, rel) if path.exists() else None  # regular, capped, UTF-8 (core.bounded_read)
        except (OSError, InputRefused, ArtifactError):
            return None

    def config(self) -> dict:
        """``config.json``, or {} when it is absent or not an object."""
        data = self.read_json(CONFIG)
        return data if isinstance(data, dict) else {}

    def report_json(self, report: Report) -> dict | list | Exception | None:
        """The JSON file of ``report`` (``read_json`` of its main file)."""
        return self.read_json(report.main)

    def recipe_data(self) -> dict | None:
        """The recipe copy as a YAML mapping (``core.artifact.read_recipe_data``), None when absent."""
        if "recipe" not in self._parts:
            self._parts["recipe"] = read_recipe_data(self.root, missing_ok=True)
        return self._parts["recipe"]

    def checkpoint(self):
        """The checkpoint's configs and safetensors headers (``core.checkpoint.Checkpoint``; no tensor
        data), read once; a ``HybridBuildError`` when they do not read."""
        if "checkpoint" not in self._parts:
            from .checkpoint import Checkpoint

            self._parts["checkpoint"] = Checkpoint.read_folder(self.root)
        return self._parts["checkpoint"]

    def recheck(self, names: list[str]) -> Integrity:
        """Those listed files against the provenance again (a ``stat`` each while unchanged): what
        ``publish`` asks just before it sends them."""
        return check_artifact(self.root, self.provenance, names=names)

    def report(self) -> dict:
        """The validation report the outcome comes from (parsed once), {} when there is none."""
        data = self.read_json(self.validation.report) if self.validation.report else None
        return data if isinstance(data, dict) else {}

    def report_state(self, report: Report) -> tuple[str, str]:
        """``core.artifact.report_state`` from what was read when the artifact was opened."""
        data = self.read_json(report.main) if report.build_field is not None else None
        return report_state(self.root, report, build=self.build or None,
                            data=data if data is not None else ValueError("not there"), sealed=self.provenance)

    def path(self, rel: str) -> Path:
        """The file ``rel`` names: checked to be a name inside the artifact and to resolve inside it
        (``core.artifact.artifact_path``), the one way a name becomes a path."""
        return artifact_path(self.root, rel)

    def require(self, hint: str = "rebuild it (`hybrid-build run`), or run the command that wrote it again") -> None:
        if self.problems:
            raise ArtifactError(f"{self.root}: {self.problem}; {hint}")

    def shipped(self) -> dict[str, str]:
        """The files ``publish`` uploads and ``serve`` reads, name -> sha256: every build output the
        provenance lists (the source's card left out: the generated card goes up as ``README.md``),
        the provenance and the recorded reports (the validate records and the card file left out)."""
        out = {n: e.sha256 for n, e in self.provenance.files.items() if n != CARD}
        out[PROVENANCE] = self.provenance_digest or _sha256(self.root / PROVENANCE)
        for name, entry in (self.provenance.reports or {}).items():
            if not is_validate_record(name) and (self.root / name).is_file():
                out[name] = entry.sha256
        return dict(sorted(out.items()))

    def signed_files(self) -> dict[str, tuple[Path, str]]:
        """What the signature covers, name -> (the file here, its sha256): ``shipped`` plus the generated
        card as ``README.md``: here, ``card.md`` (what ``publish`` kept of what it uploaded); in a
        downloaded copy, ``README.md``."""
        # a file whose bytes are not the recorded ones is compared as such (no digest matches ""): neither
        # a remembered verdict nor the provenance's digest stands in for what it holds now
        changed = self.integrity.by_file
        out = {n: (self.path(n), "" if n in changed else sha) for n, sha in self.shipped().items()}
        for rel in (REPORTS["card"].main, CARD):
            path = self.path(rel)
            if path.is_file() and not path.is_symlink():
                out[CARD] = (path, _sha256(path))
                break
        return dict(sorted(out.items()))

    def to_json(self) -> dict:
        return {"artifact": str(self.root), "build": self.build, "intact": self.intact, "problem": self.problem,
                "problems": self.problems, "files": self.integrity.to_json(), "validation": self.validation.to_json(),
                "signature": self.signature.to_json(), "built_here": self.built_here,
                "validated_here": self.validated_here, "foreign_trust_records": self.foreign}

    def trust_line(self) -> str | None:
        """One line when the folder carries trust records this machine did not write, else None."""
        if not self.foreign:
            return None
        return (f"carries trust records from elsewhere ({', '.join(self.foreign)}): ignored; this machine's "
                "own are kept in its state folder")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path, path.name) as f:  # a FIFO in a file's place is refused, never waited on
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def unfinished(root: Path) -> str | None:
    """Why ``root`` is a build that has not finished (in progress, or stopped), or None."""
    marker = Path(root) / IN_PROGRESS
    if not marker.is_file():
        return None
    try:
        pid = int(read_json(marker, IN_PROGRESS, cap=SMALL_JSON).get("pid"))
    except (OSError, InputRefused, ValueError, TypeError, AttributeError):
        pid = None
    alive = False
    if pid:
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
    if alive:
        return f"`hybrid-build run` (pid {pid}) is still writing this build; wait for it to finish"
    return "a build that stopped part-way (its in-progress marker is there): resume it with `hybrid-build run`"


def symlinks(root: Path) -> list[str]:
    """Every symbolic link in the artifact (dot folders, the work folder, left out), one line each."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                rel = path.relative_to(root).as_posix()
                found.append(f"{rel} is a symbolic link (to {os.readlink(path)}): an artifact holds regular files "
                             "only; remove it")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (Path(dirpath) / d).is_symlink())
    return found


def reference_problems(root: Path, recorded: dict | None) -> list[str]:
    """The reference against the digests the validation report records, and its values: finite
    log-probabilities <= 0 and token ids >= 0 (a reference of NaNs would silently turn the KL checks
    off). [] when it is sound or absent."""
    root = Path(root)
    problems = []
    present = [rel for rel in REFERENCE.files if (root / rel).is_file()]
    if not present:
        return []
    if recorded is not None:
        for rel in REFERENCE.files:
            name = rel.rsplit("/", 1)[1]
            want = recorded.get(name)
            if not (root / rel).is_file():
                problems.append(f"{rel} is missing; {REPORTS['validation'].main} rests on it")
            elif want != _sha256(root / rel):
                problems.append(f"{rel} is not the reference {REPORTS['validation'].main} records (sha256 differs)")
    path = root / REFERENCE.named(".safetensors")
    if not path.is_file() or problems:
        return problems
    import numpy as np
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        return [f"{REFERENCE.named('.safetensors')} is unreadable ({' '.join(str(e).split())})"]
    for name, t in sorted(tensors.items()):
        if name.endswith("logprobs") or name.endswith("logprob"):
            bad = ~np.isfinite(t) | (t > 1e-4)  # a log-probability is <= 0 (fp32 rounding allowed)
        elif name.endswith("top_ids"):
            bad = t < 0
        else:
            continue
        if bad.any():
            return [f"{REFERENCE.named('.safetensors')}: {name} holds {int(bad.sum())} value(s) that are not "
                    f"{'finite log-probabilities <= 0' if 'logprob' in name else 'token ids'} (e.g. "
                    f"{t[bad].flat[0]!r}); the reference is refused whole"]
    return problems


def _report_problems(data, validation: ValidationOutcome) -> tuple[list[str], dict | None]:
    """A report (``data``, parsed) that contradicts itself, and the reference digests it records."""
    if not validation.report:
        return [], None
    if not isinstance(data, dict):
        return [], None
    problems = []
    failures = data.get("failures") or []
    if data.get("passed") is True and failures:
        problems.append(f"{validation.report} says passed but lists {len(failures)} failure(s)")
    ref = data.get("reference_sha256")
    return problems, ref if isinstance(ref, dict) else None


def record_validated_here(root: Path, outcome: str, bundled: bool) -> None:
    """After ``validate`` on this machine: a pass on the bundled texts is recorded for the build in the
    user's state folder (``core.local_trust``), where a downloaded folder cannot put one; a run that
    failed takes it back."""
    from . import local_trust

    build = provenance_sha256(root)
    if not build or not bundled:
        return
    if outcome == "passed":
        local_trust.remember(build, local_trust.VALIDATED, root)
    elif outcome == "failed":
        local_trust.forget(build, local_trust.VALIDATED)


# the files through which a folder once claimed to be built or validated here: what a download can
# carry, worth nothing now that the claims live in the state folder (named when a folder has them)
CLAIMS = (f"{WORK_DIR}/record.json", VALIDATED_HERE)


def foreign_claims(root: Path, built_here: bool) -> list[str]:
    """The files of ``CLAIMS`` in ``root`` that this machine's records do not back: a folder built
    here keeps the record stage's manifest; any other such file came from elsewhere (or from a
    hybrid-build that kept its records inside the artifact) and is ignored."""
    backed = {CLAIMS[0]: built_here, CLAIMS[1]: False}
    return [rel for rel in CLAIMS if not backed[rel] and (Path(root) / rel).exists()]


def trusted_keys(given: list[str] | None = None) -> list[Path]:
    """The public keys a signature is checked with: ``--trust-key`` files, else those named in
    ``HYBRID_BUILD_TRUSTED_KEYS`` (paths separated by the OS path separator)."""
    names = list(given or []) or [p for p in os.environ.get("HYBRID_BUILD_TRUSTED_KEYS", "").split(os.pathsep) if p]
    keys = []
    for n in names:
        p = Path(n).expanduser()
        if not p.is_file():
            raise UserError(f"--trust-key {n}: no such file")
        keys.append(p)
    return keys


def _index_problems(bound: BoundArtifact) -> list[str]:
    """The index's entries that are not names inside the artifact (never opened by those names)."""
    index = bound.read_json(INDEX)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        return []
    bad = sorted({v if isinstance(v, str) else repr(v) for v in wm.values()
                  if not isinstance(v, str) or name_problem(v)})
    return [f"{INDEX}: {name_problem(b) or b + ' is not a file name'}: not a name inside the artifact" for b in bad]


def open_artifact(path: str | Path, *, trusted: list[Path] | None = None, progress: ProgressFactory = null_progress,
                  missing_ok: bool = False, check_files: bool = True) -> BoundArtifact | None:
    """The artifact at ``path``, opened and checked once (the module's docstring). A build that has not
    finished is an ``ArtifactError``; a folder that is no build of hybrid-build (no provenance, no
    ``META_DIR``, no work folder) is a ``UserError``, or None with ``missing_ok`` (a plain
    checkpoint, which serve may still serve). ``check_files=False``: the provenance, the validation
    and the parts a card is made of, without hashing a file or checking the signature (``run``'s card)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"{root}: no such artifact folder")
    why = unfinished(root)
    if why:
        raise ArtifactError(f"{root}: not an artifact: {why}")
    raw = provenance_bytes(root)
    if raw is None:
        if (root / META_DIR).is_dir() or (root / WORK_DIR / "inspect.json").is_file():  # a stage ran here
            raise ArtifactError(f"{root}: not an artifact: a build that did not finish (no {PROVENANCE}): resume "
                                "it with `hybrid-build run`")
        if missing_ok:
            return None
        read_provenance(root)  # its one line
    prov = parse_provenance_bytes(raw, root)
    build = build_digest(raw)
    from . import local_trust

    built_here = local_trust.recalled(build, local_trust.BUILT) is not None
    validated_here = local_trust.recalled(build, local_trust.VALIDATED) is not None
    bound = BoundArtifact(root, prov, build, Integrity(), ValidationOutcome("missing", "not read yet"),
                          SignatureCheck("unsigned"), [], built_here=built_here, validated_here=validated_here,
                          foreign=foreign_claims(root, built_here), provenance_digest=hashlib.sha256(raw).hexdigest())
    bound.validation = validation_outcome(root, build=build, read=bound.read_json)
    if not check_files:
        return bound
    problems = bound.problems
    problems += symlinks(root)
    found = check_artifact(root, prov, progress)
    bound.integrity = found
    # the layout of a downloaded copy (no work folder, no card.md): its README.md is the card publish
    # generated, which the signature covers (a layout, not a trust: it only moves README.md's check)
    downloaded = not (root / WORK_DIR / "record.json").is_file()
    if downloaded and CARD in found.by_file and not (root / REPORTS["card"].main).exists():
        found.problems.remove(found.by_file.pop(CARD))
    problems += [p for p in found.problems if not any(p.startswith(s.split(" is a symbolic")[0] + " ")
                                                      for s in problems)]
    problems += _index_problems(bound)
    own, ref_digests = _report_problems(bound.read_json(bound.validation.report) if bound.validation.report
                                        else None, bound.validation)
    problems += own
    if not found.intact and any(r in found.by_file for r in REFERENCE.files):
        pass  # the reference's bytes are already named
    else:
        problems += reference_problems(root, ref_digests)
    sig = root / SIGNATURE
    if os.path.lexists(sig):  # a FIFO or device in its place too: check_signature refuses it, unopened
        if sig.is_symlink():
            bound.signature = SignatureCheck("invalid", problem=f"{SIGNATURE} is a symbolic link")
        else:
            try:
                bound.signature = check_signature(sig, bound.signed_files(), list(trusted or []))
            except ArtifactError as e:  # a signed name that leads outside the folder: a problem line, not a crash
                bound.signature = SignatureCheck("invalid", problem=str(e))
        if bound.signature.state == "invalid":
            problems.append(bound.signature.line())
    return bound
