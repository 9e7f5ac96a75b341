"""The runner: order, keys, manifests, resume, skipping and background overlap, for any stage.

It knows stages only through their declarations (``stages.base.Stage``): a stage's manifest key
hashes the tool version, the source's content fingerprint, the stage's ``inputs`` and the keys
of the stages it ``reads``; a stage whose manifest still matches is skipped, so an interrupted
build resumes. Before the first write, every selected stage's ``check`` runs. A ``background``
stage that has to run, and whose reader has to run too, is started on a thread as soon as what
it reads is done; the reader gets it as a ``Pending`` output (its file's layout, tensors handed
over in memory as they are computed) and the background stage reports before its reader.

Each stage writes its manifest to ``OUT/.hybrid-build/<stage>.json`` when it finishes. On a
fresh build the source's digests are still being computed then (``source_identity``): the
manifest is saved as soon as they are known, at the latest when the build ends.

A folder that holds a provenance is checked against it before a finished stage is reused
(``artifact_changes``: ``core.integrity``, with its hash cache): a stage whose files in the
artifact differ, and every stage that reads its result, is not current. Such a stage re-runs and
says why; a selected stage that would read it without it being selected stops, naming the file.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_build.core import __version__
from hybrid_build.core.artifact import read_provenance
from hybrid_build.core.byte_units import human_bytes
from hybrid_build.core.errors import ArtifactError, HybridBuildError, StageFailed, StorageError, UserError
from hybrid_build.core.integrity import check_artifact
from hybrid_build.core.manifest import StageManifest, describe_outputs, sha256_json
from hybrid_build.core.output_lock import hold_output
from hybrid_build.core.progress import ProgressFactory, null_progress

if TYPE_CHECKING:
    from hybrid_build.core.provenance import Provenance

from .context import BuildContext, output_bytes
from .stages import STAGES, load_stage
from .stages.base import Finished, Handover, Pending, Stage, StageIO, StageOutput

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    stage: str
    status: str  # "ran" | "skipped" | "failed"
    seconds: float
    details: dict
    background: bool = False  # ran on a thread alongside the stage that read it (its seconds overlap)
    reason: str = ""  # why a finished stage ran again, when the artifact's files were the cause


def select_stages(only: list[str] | None, start: str | None) -> list[str]:
    for s in (only or []) + ([start] if start else []):
        if s not in STAGES:
            raise UserError(f"unknown stage {s!r} (stages: {', '.join(STAGES)})")
    if only and start:
        raise UserError("--only and --from cannot be combined")
    if only:
        return [s for s in STAGES if s in only]
    if start:
        return list(STAGES[STAGES.index(start):])
    return list(STAGES)


def stage_inputs(ctx: BuildContext, name: str) -> dict:
    """What a stage's result depends on; its hash is the manifest key."""
    stage = load_stage(name)
    return {"tool": __version__, "source": ctx.fingerprint(), "inputs": stage.inputs(ctx),
            "reads": {up: stage_key(ctx, up) for up in stage.reads}}


def stage_key(ctx: BuildContext, name: str) -> str:
    return sha256_json(stage_inputs(ctx, name))


def _current_manifest(ctx: BuildContext, name: str, changed: dict[str, str] | None = None) -> StageManifest | None:
    """The stage's manifest if it still matches its inputs, its outputs are intact, what it
    states still holds (``Stage.current``) and its files in the artifact are not ``changed``."""
    if name in (changed or {}):
        return None
    m = StageManifest.load(ctx.work / f"{name}.json")
    if not (m and m.still_valid(ctx.out, stage_key(ctx, name))):
        return None
    stage = load_stage(name)
    return None if stage.current and stage.current(ctx.out) else m


def artifact_changes(out: Path, manifests: dict[str, StageManifest | None],
                     progress: ProgressFactory = null_progress) -> dict[str, str]:
    """Stage -> why its finished result no longer holds because the artifact's files differ from
    the provenance (``core.integrity``, through its hash cache): the stage whose manifest lists the
    first such file (``assemble`` when none does), and every stage that reads it, directly or not.
    {} when the folder holds no provenance or its files match. A file the provenance does not list
    is no stage's result (validate and publish refuse it; ``record`` would list it)."""
    prov = read_provenance(out, missing_ok=True)
    if prov is None:
        return {}
    return stage_changes(check_artifact(out, prov, progress, reports=False).by_file, prov, manifests)


def stage_changes(problems: dict[str, str], provenance: Provenance,
                  manifests: dict[str, StageManifest | None]) -> dict[str, str]:
    """``artifact_changes`` from the problems ``core.integrity`` found (file -> line)."""
    listed = provenance.files
    changed: dict[str, str] = {}
    for rel, line in problems.items():
        if rel in listed:
            owner = next((s for s in STAGES if manifests.get(s) and rel in manifests[s].outputs), "assemble")
            changed.setdefault(owner, f"the artifact differs from its provenance: {line}")
    for name in STAGES:  # a reader comes after what it reads
        up = next((u for u in load_stage(name).reads if u in changed), None)
        if up and name not in changed:
            changed[name] = changed[up]
    return changed


def _finished(ctx: BuildContext, m: StageManifest) -> Finished:
    return Finished([ctx.out / rel for rel in m.outputs], m.details)


def stage_status(ctx: BuildContext) -> dict[str, str]:
    """For --dry-run: which stages would run and which are up to date."""
    return {s: "up to date" if (ctx.work / f"{s}.json").exists() and _current_manifest(ctx, s) else "would run"
            for s in STAGES}


def upstream_outputs(ctx: BuildContext, names: tuple[str, ...]) -> dict[str, StageOutput]:
    """The current results of finished stages, as a reader receives them."""
    out = {}
    for name in names:
        m = _current_manifest(ctx, name)
        if m is None:
            raise UserError(f"no current {name} result; run without --only/--from, or --from {name}")
        out[name] = _finished(ctx, m)
    return out


def planned_writes(ctx: BuildContext, names: list[str]) -> dict[str, int]:
    """Bytes each of the stages would write, as they plan it from headers."""
    return {n: stage.writes(ctx) for n in names if (stage := load_stage(n)).writes}


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent: where a folder not yet made will live."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_writable(out: Path) -> None:
    """Refuse, before creating anything, an output on a read-only filesystem or in a folder this
    user cannot write: the same error the first write would raise (``cli`` words it)."""
    where = _existing(out)
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out))
    if not os.access(where, os.W_OK):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(out))


def check_free_space(ctx: BuildContext, names: list[str]) -> None:
    """Refuse, before writing anything, a build that the output's filesystem cannot hold."""
    writes = planned_writes(ctx, names)
    need = sum(writes.values())
    # files this build replaces give their space back (shards are renamed over them)
    need -= sum(p.stat().st_size for p in ctx.out.glob("*.safetensors"))
    need -= sum(p.stat().st_size for p in ctx.work.glob("*/*.safetensors"))
    free = shutil.disk_usage(_existing(ctx.out)).free
    if need > free:
        parts = ", ".join(f"{n} ~{human_bytes(b)}" for n, b in writes.items() if b)
        raise StorageError(f"{ctx.out}: {human_bytes(free)} free on its filesystem, this build writes about "
                           f"{human_bytes(need)} ({parts}); free some space or choose another folder")


def dry_run(ctx: BuildContext, stages: list[str]) -> dict:
    """What a build of ``stages`` would do: the recipe, the conversions, sizes, which stages are up
    to date, and what a stage can describe once the stages it reads are current (the output
    shards). Writes nothing."""
    status = stage_status(ctx)
    data = {"recipe": ctx.recipe.name, "recipe_choice": ctx.recipe_note, "output": str(ctx.out),
            "format": ctx.recipe.output.format, "stages": {s: status[s] for s in stages},
            "conversion": ctx.plan.to_json(), "source_bytes": sum(t.nbytes for t in ctx.source.tensors.values()),
            "output_bytes_estimate": output_bytes(ctx), "planned_writes": planned_writes(ctx, list(STAGES))}
    for name in stages:
        stage = load_stage(name)
        if stage.describe and all(status[up] == "up to date" for up in stage.reads):
            data.update(stage.describe(ctx, upstream_outputs(ctx, stage.reads)))
    return data


def run_build(ctx: BuildContext, stages: list[str] | None = None, force: bool | list[str] = False,
              on_stage: Callable[[StageResult], None] | None = None) -> list[StageResult]:
    """Run the selected stages in order, skipping those whose manifests still match.

    ``force`` re-runs every selected stage (True) or the ones named. Returns one result per
    stage; ``on_stage`` sees each as it is decided. A failure is raised with ``stage`` set to
    the stage that failed; what finished before it keeps its manifest, so the next run resumes."""
    return _Run(ctx, stages or list(STAGES), force, on_stage).run()


class _Run:
    def __init__(self, ctx: BuildContext, stages: list[str], force: bool | list[str],
                 on_stage: Callable[[StageResult], None] | None) -> None:
        self.ctx = ctx
        self.names = list(stages)
        self.stages = {n: load_stage(n) for n in self.names}
        self.forced = set(self.names) if force is True else set(force or ())
        self.on_stage = on_stage
        self.results: list[StageResult] = []
        self.done: dict[str, StageOutput] = {}  # ran or current in this run
        self.pending: dict[str, _Background] = {}
        self.deferred: list[Callable[[], None]] = []  # manifest saves waiting for the source's digests
        self._changed: dict[str, str] | None = None  # artifact_changes, once a finished stage is looked at

    def report(self, res: StageResult) -> None:
        self.results.append(res)
        if self.on_stage:
            self.on_stage(res)

    def run(self) -> list[StageResult]:
        ctx = self.ctx
        check_writable(ctx.out)
        check_free_space(ctx, self.names)
        for stage in self.stages.values():  # every check before the first write (the folders included)
            if stage.check:
                stage.check(ctx)
        ctx.out.mkdir(parents=True, exist_ok=True)
        ctx.work.mkdir(exist_ok=True)
        with hold_output(ctx.out):  # one writer; the folder is marked in progress until the build is complete
            return self._run_locked()

    def _run_locked(self) -> list[StageResult]:
        ctx = self.ctx
        ctx.record_recipe()  # `status` keys the stages with the last run's recipe
        if not ctx.digests.ready:
            # a manifest to reuse needs the digests now; otherwise they are hashed alongside the stages
            if any(n not in self.forced and (ctx.work / f"{n}.json").exists() for n in self.names):
                ctx.digests.compute(ctx.progress)
            else:
                ctx.digests.start()
        name = None
        try:
            for name in self.names:
                self._save_deferred(wait=False)
                self._start_background()
                if name in self.pending:
                    continue
                stage = self.stages[name]
                m = None if name in self.forced else self._manifest_if_current(name)
                log.debug("%s: %s", name, "forced" if name in self.forced else
                          f"current (key {m.key[:12]})" if m else self._why_not_current(name))
                if m is not None:
                    self.done[name] = _finished(ctx, m)
                    self.report(StageResult(name, "skipped", 0.0, m.details))
                    continue
                io = StageIO(up=self._upstream(stage))
                res = self._run_stage(stage, io)
                res.reason = (self._changed or {}).get(name, "")
                for up in stage.reads:  # a background stage reports before the stage that read it
                    if up in self.pending:
                        name = up
                        self.report(self.pending.pop(up).result())
                name = stage.name
                self.report(res)
            name = None
            self._save_deferred(wait=True)
        except (HybridBuildError, OSError) as e:
            e.stage = getattr(e, "stage", None) or name  # for `run --json`: which stage failed
            raise
        finally:
            for bg in self.pending.values():
                bg.join()  # never leave a stage running behind a failure; it records its manifest itself
            self.pending.clear()
            try:
                self._save_deferred(wait=False)  # after a failure: what finished is kept if it can be keyed
            except OSError as e:  # the disk that failed the stage fails this too: the stage's error is the one said
                log.info("the finished stages' records were not kept: %s: %s", e.filename, e.strerror)
        return self.results

    @property
    def changed(self) -> dict[str, str]:
        """``artifact_changes`` of the folder as this run found it (checked once, when first needed;
        nothing to check when assemble is forced to rewrite the checkpoint)."""
        if self._changed is None:
            ctx = self.ctx
            self._changed = {} if "assemble" in self.forced else artifact_changes(
                ctx.out, {s: StageManifest.load(ctx.work / f"{s}.json") for s in STAGES}, ctx.progress)
            for name, why in self._changed.items():
                log.info("%s: not reused: %s", name, why)
        return self._changed

    def _manifest_if_current(self, name: str) -> StageManifest | None:
        if not (self.ctx.work / f"{name}.json").exists():
            return None  # nothing to reuse: no need to wait for the source's digests
        return _current_manifest(self.ctx, name, self.changed)

    def _why_not_current(self, name: str) -> str:
        """For -vv: why a stage runs (the first cause found)."""
        m, why = StageManifest.read(self.ctx.work / f"{name}.json")
        if m is None:
            return why
        key = stage_key(self.ctx, name)
        if m.key != key:
            return f"key {m.key[:12]} -> {key[:12]} (its inputs or an upstream stage changed)"
        return m.output_problem(self.ctx.out) or "its outputs are intact"

    def _will_run(self, name: str) -> bool:
        if name not in self.stages or name in self.done:
            return False
        return name in self.forced or self._manifest_if_current(name) is None

    def _start_background(self) -> None:
        """Start each background stage that has to run, whose reads are done and whose reader runs."""
        for name, stage in self.stages.items():
            if not stage.background or name in self.pending or name in self.done:
                continue
            if not all(up in self.done for up in stage.reads):
                continue
            readers = [r for r, s in self.stages.items() if name in s.reads]
            if not any(self._will_run(r) for r in readers) or not self._will_run(name):
                continue
            plan = stage.layout(self.ctx) if stage.layout else None
            if plan is None:
                continue
            bg = _Background(self, stage, StageIO(up=self._upstream(stage), handover=Handover()), plan)
            self.pending[name] = bg
            bg.start()

    def _upstream(self, stage: Stage) -> dict[str, StageOutput]:
        """What ``stage`` reads: results of this run, running stages, or current manifests."""
        up = {}
        for name in stage.reads:
            if name in self.pending:
                up[name] = self.pending[name].output
            elif name in self.done:
                up[name] = self.done[name]
            else:
                m = _current_manifest(self.ctx, name, self.changed)
                if m is None and name in self.changed:
                    first = next(s for s in STAGES if s in self.changed)
                    raise ArtifactError(f"stage {stage.name} needs the {name} result, but {self.changed[name]}; "
                                        f"run --from {first} to rebuild it")
                if m is None:
                    raise UserError(f"stage {stage.name} needs a current {name} result; run without "
                                    f"--only/--from, or --from {name}")
                up[name] = self.done[name] = _finished(self.ctx, m)
        return up

    def _run_stage(self, stage: Stage, io: StageIO) -> StageResult:
        ctx = self.ctx
        t = time.perf_counter()
        try:
            paths, details = stage.run(ctx, io)
        except StageFailed as e:
            self.report(StageResult(stage.name, "failed", time.perf_counter() - t, e.details))
            raise
        secs = time.perf_counter() - t
        hashes = details.pop("_hashes", None)
        manifest = StageManifest(stage.name, "", {}, describe_outputs(ctx.out, paths, hashes), details,
                                 round(secs, 3), time.time())
        self.done[stage.name] = _finished(ctx, manifest)

        def save() -> None:  # the key needs the source's digests: saved once they are known
            manifest.inputs = stage_inputs(ctx, stage.name)
            manifest.key = sha256_json(manifest.inputs)
            ctx.record_location()  # `status` finds the source that this key hashes
            manifest.save(ctx.work / f"{stage.name}.json")
            log.debug("%s: manifest saved (key %s, %d outputs)", stage.name, manifest.key[:12], len(manifest.outputs))

        if ctx.digests.ready or threading.current_thread() is not threading.main_thread():
            save()
        else:
            self.deferred.append(save)
        return StageResult(stage.name, "ran", secs, details)

    def _save_deferred(self, wait: bool) -> None:
        if self.deferred and (wait or self.ctx.digests.ready):
            self.ctx.digests.result(self.ctx.progress)
            while self.deferred:
                self.deferred.pop(0)()


class _Background:
    """One stage running on a thread; its reader sees it as ``output`` (a ``Pending``)."""

    def __init__(self, run: _Run, stage: Stage, io: StageIO, plan) -> None:
        self.stage, self.io = stage, io
        self._result: StageResult | None = None
        self._error: BaseException | None = None
        self.output = Pending(run.ctx.work / stage.name / plan.filename, plan, io.handover, self._details)
        self._thread = threading.Thread(target=self._work, args=(run,), name=f"stage-{stage.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _work(self, run: _Run) -> None:
        try:
            self._result = run._run_stage(self.stage, self.io)
            self._result.background = True
        except BaseException as e:  # noqa: BLE001  (raised by result())
            self._error = e
        finally:
            self.io.handover.close()

    def join(self) -> None:
        self._thread.join()

    def result(self) -> StageResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _details(self) -> dict:
        return self.result().details
