"""Publishing an artifact to the Hugging Face Hub: plan, upload, verify.

``plan_publish`` reads the artifact (nothing leaves the machine): it checks every file against the
provenance manifest by size and sha256 (``core.integrity``, through its hash cache; never skipped),
refuses one whose validation is missing, stale, failed or could not run unless forced, and renders
the model card. Just before the upload its files are checked again (a ``stat`` each when unchanged).
``publish`` sends the plan through an ``HfApi``-like object (the boundary: the real ``HfApi`` by
default, a recording stand-in in tests): it creates the repo, asks the Hub which files it already
holds with the expected sha256, and sends the rest in one ``upload_folder`` call naming them
exactly; huggingface_hub (1.20 on) commits a large upload in batches itself and resumes it when
rerun. ``HfApi.upload_large_folder`` is not used: deprecated in the huggingface_hub installed, it
takes no commit message, opens no pull request, and writes its resume records into the folder it
uploads (``lab/probes/upload_large_folder.py``). ``verify_remote`` then checks the remote file
list, sizes and hashes against the plan. Network failures are retried with backoff, asking again
what arrived; the token is never logged.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.artifact import CARD, META_DIR, PROVENANCE, REPORT_FILES, REPORTS
from hybrid_build.core.bound import BoundArtifact, open_artifact
from hybrid_build.core.bounded_read import open_regular
from hybrid_build.core.errors import ArtifactError, CannotRun, UserError
from hybrid_build.core.progress import null_progress
from hybrid_build.core.provenance import Provenance
from hybrid_build.core.safetensors_io import INDEX_NAME, write_text_atomic

from .modelcard import LicenseInfo, ValidationStatus, card_inputs, render_card

log = logging.getLogger(__name__)

# Files the Hub creates itself; their presence on the remote is expected.
HUB_OWN_FILES = {".gitattributes"}
PATHS_INFO_CHUNK = 100
TITLE_PREFIX = "hybrid-build publish"


# ------------------------------------------------------------------------------------ the plan


@dataclass
class PublishFile:
    """One file of the repo: where its bytes come from and what the Hub must end up holding."""

    path: str
    bytes: int
    sha256: str
    origin: str  # "provenance" (hash from the manifest), "local" (hashed here) or "card"
    local: Path | None = None
    data: bytes | None = None  # the rendered card

    def git_sha1(self) -> str:
        """Git blob id, which the Hub reports for files it does not keep in LFS."""
        h = hashlib.sha1(f"blob {self.bytes}\0".encode())
        if self.data is not None:
            h.update(self.data)
        else:
            with open_regular(self.local, self.path) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()

    def local_sha256(self) -> str:
        if self.data is not None:
            return hashlib.sha256(self.data).hexdigest()
        return _sha256_file(self.local)


@dataclass
class PublishPlan:
    artifact: Path
    repo_id: str | None  # None: a plan of the card alone (``write_card``)
    files: list[PublishFile]  # upload order; the card last
    card_text: str
    validation: ValidationStatus
    forced: bool
    artifact_id: str  # short hash of provenance.json: names the upload's commits and PR
    license: LicenseInfo
    notes: list[str] = field(default_factory=list)
    provenance: Provenance | None = None
    checked: dict | None = None  # core.integrity's count of what was checked (None: not checked)
    signed_seconds: float | None = None  # sign_plan's time (None: not signed)
    bound: BoundArtifact | None = field(default=None, repr=False)  # the artifact, opened and checked once

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict:
        return {"artifact": str(self.artifact), "repo_id": self.repo_id, "artifact_id": self.artifact_id,
                "validation": self.validation.state, "forced": self.forced, "license": self.license.license,
                "files": [{"path": f.path, "bytes": f.bytes, "sha256": f.sha256} for f in self.files],
                "total_bytes": self.total_bytes, "notes": self.notes, "checked": self.checked}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path, path.name) as f:  # a FIFO in a file's place is refused, never waited on
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_validation(bound) -> ValidationStatus:
    """The build's validation as the bound artifact found it (``core.artifact.validation_outcome``: a
    failed run kept beside a passing report counts as failed), with the report it comes from."""
    validation = REPORTS["validation"]
    outcome = bound.validation
    if outcome.state == "missing":
        return ValidationStatus("missing", reason=f"{validation.main} does not exist")
    report = bound.read_json(outcome.report) if outcome.report else {}
    if isinstance(report, Exception):
        return ValidationStatus("missing", reason=f"{outcome.report} is unreadable: {report}")
    if not isinstance(report, dict):
        return ValidationStatus("missing", reason=f"{outcome.report} is not a JSON object")
    if outcome.state == "passed":
        return ValidationStatus("passed", report)
    where = f" ({outcome.report}" + (f", {outcome.finished_at})" if outcome.finished_at else ")")
    return ValidationStatus(outcome.state, report, outcome.reason + where)


def _upload_order(path: str) -> tuple:
    # weights first, then the small files, then the index (a repo with an index is meant to be complete),
    # then the manifests; the card goes last, after the loop
    if path.endswith(".safetensors"):
        return (0, path)
    if path == INDEX_NAME:
        return (2, path)
    if path.startswith(META_DIR + "/"):
        return (3, path)
    return (1, path)


def plan_publish(artifact: str | Path, repo_id: str | None, *, force: bool = False, check_files: bool = True,
                 progress=null_progress) -> PublishPlan:
    """Everything ``publish`` will send, checked against the artifact's manifests; sends nothing.
    The card does not depend on ``repo_id`` (None: the plan of the card alone, ``write_card``);
    ``check_files=False`` skips hashing the files (the card says nothing of their bytes). Every part
    of the artifact is asked of the bound artifact (``core.bound``), which opens and checks it once."""
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise UserError(f"{artifact}: no such artifact folder")
    from hybrid_build.core.checkpoint import HUB_ID

    if repo_id is not None and not HUB_ID.match(repo_id):
        raise UserError(f"--repo-id {repo_id!r} is not of the form ORG/NAME")
    # check_files: in progress or stopped, symbolic links, every file and report against the provenance,
    # the reference, the signature; --force skips none of it. Without: the card alone (`run` writes it),
    # nothing uploaded, no file's bytes read
    bound = open_artifact(artifact, progress=progress, check_files=check_files)
    if check_files:
        bound.require("publish refuses it; rebuild it, or run the command that wrote that file again")
        shipped = bound.shipped()
    else:
        if not bound.path(INDEX_NAME).exists():
            raise ArtifactError(f"{artifact}: the build did not finish (run `hybrid-build run` again)")
        # the card's plan: the build's outputs, the provenance and the reports, unhashed
        shipped = {p: "" for p in bound.provenance.files if p != CARD}
        shipped.update({p: "" for p in [PROVENANCE, *REPORT_FILES]
                        if bound.path(p).is_file() and p not in REPORTS["card"].files})
    typed = bound.provenance
    validation = read_validation(bound)
    if not validation.passed and not force:
        hint = "fix the artifact, or pass --force to publish it anyway (the card will say so)"
        if validation.state == "failed":
            raise ArtifactError(f"validation FAILED: {validation.reason}: {hint}")
        if validation.state == "could not run":
            raise UserError(f"validation could not run here: {validation.reason}: run `hybrid-build validate "
                            f"{artifact}` where it can, or pass --force to publish unvalidated (the card will say so)")
        raise UserError(f"{validation.reason}: run `hybrid-build validate {artifact}` first, or pass --force "
                        "to publish unvalidated (the card will say so)")
    if not validation.passed:
        log.warning("publishing with --force although validation is %s", validation.state)

    recorded = typed.files
    notes = []
    files = []
    if CARD in recorded:
        notes.append(f"{CARD} (the source's card, copied by the build) is replaced by the generated card")
    sealed = typed.reports or {}
    # only the regular files the provenance lists (checked above: never a symlink, nothing else)
    for path in sorted(shipped, key=_upload_order):
        local = bound.path(path)
        if path in recorded:
            files.append(PublishFile(path, recorded[path].bytes, recorded[path].sha256, "provenance", local))
        elif path in sealed:
            files.append(PublishFile(path, sealed[path].bytes, sealed[path].sha256, "local", local))
        elif path == PROVENANCE:
            files.append(PublishFile(path, local.stat().st_size, bound.provenance_digest, "local", local))
        else:  # for the card alone, an unsealed report: its size is all the card needs
            files.append(PublishFile(path, local.stat().st_size, shipped[path], "local", local))

    forced = force and not validation.passed
    inputs = card_inputs(bound, validation, {f.path: f.bytes for f in files}, forced)
    if not inputs.license.known:
        notes.append(f"license: {inputs.license.origin}; the card says `{inputs.license.license}`: set it on the "
                         "Hub before sharing")
        log.info("the source's license is unknown: the card says %r", inputs.license.license)
    card_text = str(render_card(inputs))
    data = card_text.encode("utf-8")
    files.append(PublishFile(CARD, len(data), hashlib.sha256(data).hexdigest(), "card", data=data))
    return PublishPlan(artifact, repo_id, files, card_text, validation, forced, bound.build[:12], inputs.license,
                       notes, typed, bound.integrity.to_json() if check_files else None, bound=bound)


def sign_plan(plan: PublishPlan, key) -> float:
    """Sign what ``plan`` uploads (the generated card as ``README.md``) with OpenSSF Model Signing
    (``core.signing``; ``key`` a ``SigningKey``) into ``SIGNATURE`` in the artifact, and add it to the
    plan, before the card. Returns the seconds signing took."""
    from hybrid_build.core.signing import SIGNATURE, sign_files

    files = {f.path: (f.data if f.data is not None else f.local) for f in plan.files if f.path != SIGNATURE}
    keep_card(plan)  # the signed README.md's bytes stay in the folder, where a check of the signature finds them
    seconds = sign_files(files, plan.artifact / SIGNATURE, key)
    local = plan.artifact / SIGNATURE
    plan.files = [f for f in plan.files if f.path != SIGNATURE]
    plan.files.insert(len(plan.files) - 1, PublishFile(SIGNATURE, local.stat().st_size, _sha256_file(local),
                                                       "signature", local))
    plan.signed_seconds = seconds
    return seconds


def write_card(artifact: str | Path) -> Path:
    """Render the card ``publish`` would upload into the folder (``core.artifact`` names it): the
    same bytes, for the card depends on the artifact alone (``modelcard``)."""
    return keep_card(plan_publish(artifact, None, force=True, check_files=False))


def keep_card(plan: PublishPlan) -> Path:
    """The plan's card into the artifact folder: ``publish`` keeps there what it uploaded, so that the
    folder's card and the repository's README.md are the same bytes even when a report (eval, bench)
    came after ``run`` wrote the card."""
    path = REPORTS["card"].path(plan.artifact)
    if path.is_file() and path.read_bytes() == plan.card_text.encode("utf-8"):
        return path  # already the same bytes: left as it is
    path.parent.mkdir(exist_ok=True)
    return write_text_atomic(path, plan.card_text)


# ------------------------------------------------------------------------------------ retries


@dataclass
class RetryPolicy:
    """Network calls are tried ``attempts`` times, waiting base, 2*base, ... (at most ``max_delay``)."""

    attempts: int = 5
    base_delay: float = 2.0
    max_delay: float = 60.0
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1))


RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: no answer at all, a timeout, or a 5xx/429 from the Hub."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled):
        return False
    if isinstance(exc, HfHubHTTPError):
        status = _status(exc)
        return status is None or status in RETRY_STATUS
    try:
        import httpx

        if isinstance(exc, httpx.TransportError):
            return True
    except ImportError:  # pragma: no cover - huggingface_hub 1.x depends on httpx
        pass
    return isinstance(exc, (ConnectionError, TimeoutError))


class Redactor:
    """Removes the token from any text that may reach the terminal or a log."""

    def __init__(self, secret: str | None):
        self.secret = secret or None

    def __call__(self, text: str) -> str:
        return text.replace(self.secret, "***") if self.secret else text


def _one_line(exc: BaseException, redact: Redactor) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return redact(f"{type(exc).__name__}: {first}")


def hub_error(exc: BaseException, what: str, repo_id: str, redact: Redactor) -> Exception:
    """One of our errors, with one line naming the cause (``hub_errors``' mapping: offline, not
    found, gated, unauthorized, forbidden...), for a Hub failure that retrying did not cure."""
    from hybrid_build.core.hub_errors import hub_error as mapped

    # a Publisher refuses to start without a token, so one was sent
    return mapped(exc, f"{what} ({repo_id})", upload=True, repo_id=repo_id, redact=redact, has_token=True,
                  suffix="; run the same command again to resume")


def _is_hub_failure(exc: BaseException) -> bool:
    """Failures that come from talking to the Hub (as opposed to bugs, which keep their traceback)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        import httpx

        if isinstance(exc, httpx.HTTPError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, (HfHubHTTPError, OSError, ValueError))


def call_hub(policy: RetryPolicy, what: str, repo_id: str, redact: Redactor, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, retried on transient failures; anything else becomes one clear error."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below, never swallowed
            if not _is_hub_failure(e):
                raise
            if not is_transient(e):
                raise hub_error(e, what, repo_id, redact) from None
            if attempt == policy.attempts:
                raise CannotRun(f"{what}: the Hub did not answer after {policy.attempts} attempts "
                                        f"({_one_line(e, redact)}); run the same command again to resume") from None
            wait = policy.delay(attempt)
            log.info("%s: %s; retry %d/%d in %.0f s", what, _one_line(e, redact), attempt,
                        policy.attempts - 1, wait)
            policy.sleep(wait)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------ publishing


@dataclass
class PublishResult:
    repo_id: str
    revision: str
    url: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    uploaded_bytes: int = 0
    upload_calls: int = 0  # upload_folder / upload_file calls (an upload_folder call may make several commits)
    pr_url: str | None = None
    verified: int = 0
    remote_extra: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "url": self.url, "pr_url": self.pr_url,
                "uploaded": self.uploaded, "skipped": self.skipped, "uploaded_bytes": self.uploaded_bytes,
                "upload_calls": self.upload_calls, "verified": self.verified, "remote_extra": self.remote_extra}


def _token_of(api) -> str | None:
    from huggingface_hub import get_token

    tok = getattr(api, "token", None)
    return tok if isinstance(tok, str) and tok else get_token()


def _matches(remote, f: PublishFile) -> bool:
    """The remote file already holds ``f``'s content (LFS sha256, or git blob id for a small file)."""
    if remote is None or getattr(remote, "size", None) != f.bytes:
        return False
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        return getattr(lfs, "sha256", None) == f.sha256
    blob = getattr(remote, "blob_id", None)
    return blob is not None and blob == f.git_sha1()


class Publisher:
    """Sends a ``PublishPlan`` to ``repo_id`` through ``api`` (``HfApi()`` unless given)."""

    def __init__(self, plan: PublishPlan, api=None, *, private: bool = False, revision: str | None = None,
                 create_pr: bool = False, retry: RetryPolicy | None = None, progress=null_progress,
                 on_send: Callable[[list[PublishFile], int], None] | None = None):
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        self.plan, self.api = plan, api
        self.repo_id = plan.repo_id
        self.private, self.base_revision, self.create_pr = private, revision or "main", create_pr
        self.retry = retry or RetryPolicy()
        self.progress = progress
        self.on_send = on_send  # (files to send, files already there), before the upload
        token = _token_of(api)
        if not token:
            raise UserError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
        self.redact = Redactor(token)

    def _call(self, what: str, fn: Callable, *args, **kwargs):
        return call_hub(self.retry, what, self.repo_id, self.redact, fn, *args, **kwargs)

    # -- steps --------------------------------------------------------------------------------

    def ensure_repo(self) -> str:
        url = self._call("create repo", self.api.create_repo, self.repo_id, repo_type="model",
                         private=self.private or None, exist_ok=True)  # None: the namespace's default
        if self.base_revision != "main":
            self._call(f"create branch {self.base_revision}", self.api.create_branch, self.repo_id,
                       branch=self.base_revision, repo_type="model", exist_ok=True)
        return str(url)

    def _open_pr(self) -> str | None:
        """The revision of an open PR left by an earlier run of this same upload, if any."""
        title = f"{TITLE_PREFIX} {self.plan.artifact_id}"
        prs = self._call("list pull requests", lambda: list(self.api.get_repo_discussions(
            self.repo_id, discussion_type="pull_request", discussion_status="open", repo_type="model")))
        for d in prs:
            if getattr(d, "is_pull_request", True) and str(getattr(d, "title", "")).startswith(title):
                return f"refs/pr/{d.num}"
        return None

    def remote_files(self, paths: list[str], revision: str) -> dict:
        """path -> RepoFile for those of ``paths`` that exist at ``revision``."""
        found = {}
        for i in range(0, len(paths), PATHS_INFO_CHUNK):
            chunk = paths[i:i + PATHS_INFO_CHUNK]
            infos = self._call("read remote files", self.api.get_paths_info, self.repo_id, chunk,
                               expand=True, revision=revision, repo_type="model")
            for info in infos:
                if hasattr(info, "size"):
                    found[info.path] = info
        return found

    def _missing(self, files: list[PublishFile], revision: str) -> list[PublishFile]:
        remote = self.remote_files([f.path for f in files], revision)
        return [f for f in files if not _matches(remote.get(f.path), f)]

    def _commit_message(self) -> str:
        return f"{TITLE_PREFIX} {self.plan.artifact_id}: {self.plan.artifact.name}"

    def _send(self, files: list[PublishFile], revision: str, create_pr: bool, message: str):
        cards = [f for f in files if f.data is not None]
        folder = [f for f in files if f.data is None]
        info, calls = None, 0
        if folder:
            info = self.api.upload_folder(
                repo_id=self.repo_id, repo_type="model", folder_path=str(self.plan.artifact),
                allow_patterns=[glob.escape(f.path) for f in folder], ignore_patterns=[".*", ".*/**"],
                commit_message=message, revision=revision, create_pr=create_pr or None)
            calls += 1
            if create_pr:
                revision, create_pr = getattr(info, "pr_revision", None) or revision, False
        for f in cards:
            first = info
            info = self.api.upload_file(path_or_fileobj=f.data, path_in_repo=f.path, repo_id=self.repo_id,
                                        repo_type="model", revision=revision, commit_message=message,
                                        create_pr=create_pr or None)
            calls += 1
            info = first or info  # the first call is the one that opened a PR, if one was opened
        return info, calls

    def upload(self, result: PublishResult) -> str:
        """Upload what the remote lacks; returns the revision holding the files."""
        revision, create_pr = self.base_revision, False
        if self.create_pr:
            existing = self._open_pr()
            if existing:
                log.info("resuming into the open pull request %s", existing)
                revision = existing
            else:
                create_pr = True
        files = self.plan.files
        bar = self.progress(total=self.plan.total_bytes, desc="upload", unit="B", unit_scale=True)
        try:
            todo = self._missing(files, revision)
            done = [f for f in files if f not in todo]
            result.skipped += [f.path for f in done]
            bar.update(sum(f.bytes for f in done))
            self._check_unchanged(todo)
            if self.on_send:
                self.on_send(todo, len(done))
            attempt = 0
            while todo:
                attempt += 1
                try:
                    info, calls = self._send(todo, revision, create_pr, self._commit_message())
                except Exception as e:  # noqa: BLE001 - classified: transient ones are retried
                    if not _is_hub_failure(e):
                        raise
                    if not is_transient(e):
                        raise hub_error(e, "upload", self.repo_id, self.redact) from None
                    if attempt >= self.retry.attempts:
                        raise CannotRun(f"upload: the Hub did not answer after {attempt} attempts ("
                                        f"{_one_line(e, self.redact)}); run the same command again to resume") from None
                    wait = self.retry.delay(attempt)
                    log.info("upload: %s; retry in %.0f s", _one_line(e, self.redact), wait)
                    self.retry.sleep(wait)
                    if create_pr:  # the failed call may have opened the PR already
                        revision = self._open_pr() or revision
                        create_pr = revision == self.base_revision
                    # ask again: part of it may have arrived (been committed) before the failure
                    before = todo
                    todo = self._missing(todo, revision)
                    arrived = [f for f in before if f not in todo]
                    result.uploaded += [f.path for f in arrived]
                    result.uploaded_bytes += sum(f.bytes for f in arrived)
                    bar.update(sum(f.bytes for f in arrived))
                    continue
                result.upload_calls += calls
                if create_pr:
                    result.pr_url = getattr(info, "pr_url", None)
                    revision = getattr(info, "pr_revision", None) or revision
                    create_pr = False
                result.uploaded += [f.path for f in todo]
                result.uploaded_bytes += sum(f.bytes for f in todo)
                bar.update(sum(f.bytes for f in todo))
                todo = []
        finally:
            bar.close()
        if revision.startswith("refs/pr/") and not result.pr_url:
            result.pr_url = f"https://huggingface.co/{self.repo_id}/discussions/{revision.rsplit('/', 1)[-1]}"
        return revision

    def _check_unchanged(self, files: list[PublishFile]) -> None:
        """The build outputs to send are still the provenance's bytes (checked when the plan was made;
        a ``stat`` each now through the hash cache, a hash only for a file written to since)."""
        names = [f.path for f in files if f.origin == "provenance"]
        if names and self.plan.bound is not None:
            found = self.plan.bound.recheck(names)
            if not found.intact:
                raise ArtifactError(f"{self.plan.artifact}: the artifact changed after it was checked: "
                                    f"{found.problem}; nothing was sent")

    def run(self) -> PublishResult:
        url = self.ensure_repo()
        result = PublishResult(self.repo_id, self.base_revision, url)
        log.info("publishing %d files (%d bytes) to %s", len(self.plan.files), self.plan.total_bytes, self.repo_id)
        result.revision = self.upload(result)
        verified, extra = verify_remote(self.api, self.plan, result.revision, retry=self.retry, redact=self.redact)
        result.verified, result.remote_extra = verified, extra
        return result


def verify_remote(api, plan: PublishPlan, revision: str = "main", *, retry: RetryPolicy | None = None,
                  redact: Redactor | None = None) -> tuple[int, list[str]]:
    """Check the repo at ``revision`` holds every planned file with its size and hash.

    LFS files are compared by sha256 with the provenance manifest; files the Hub keeps in git by
    their blob id, after checking the local copy's sha256 against the manifest. Raises
    ``ArtifactError`` naming the first bad file; returns (files verified, remote files not planned)."""
    retry = retry or RetryPolicy()
    redact = redact or Redactor(None)
    tree = call_hub(retry, "list remote files", plan.repo_id, redact,
                    lambda: list(api.list_repo_tree(plan.repo_id, recursive=True, expand=True, revision=revision,
                                                    repo_type="model")))
    remote = {f.path: f for f in tree if hasattr(f, "size")}
    problems = []
    for f in plan.files:
        r = remote.get(f.path)
        if r is None:
            problems.append(f"{f.path}: missing on the Hub")
            continue
        if r.size != f.bytes:
            problems.append(f"{f.path}: {r.size} bytes on the Hub, {f.bytes} expected")
            continue
        lfs = getattr(r, "lfs", None)
        if lfs is not None:
            if lfs.sha256 != f.sha256:
                problems.append(f"{f.path}: sha256 {lfs.sha256} on the Hub, {f.sha256} expected"
                                + (f" (from {PROVENANCE})" if f.origin == "provenance" else ""))
            continue
        if f.origin == "provenance" and f.local_sha256() != f.sha256:
            problems.append(f"{f.path}: the local file's sha256 differs from {PROVENANCE}: the artifact changed "
                            "after the build")
        elif r.blob_id != f.git_sha1():
            problems.append(f"{f.path}: git blob {r.blob_id} on the Hub, {f.git_sha1()} expected")
    if problems:
        raise ArtifactError("remote verification failed: " + problems[0]
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    planned = {f.path for f in plan.files}
    extra = sorted(p for p in remote if p not in planned and p not in HUB_OWN_FILES)
    for p in extra:
        log.warning("the repo also holds %s, which this artifact does not have", p)
    return len(plan.files), extra
