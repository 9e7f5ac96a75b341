"""The build: recipe -> plan (headers only) -> stages -> artifact folder.

Stages, in order: ``inspect`` (check the source), ``calibrate`` (shared experts -> FP8 block-128),
``quantize-head`` (lm-head -> int8 per row), ``assemble`` (write the output checkpoint) and
``validate``. Intermediate results live in ``OUT/.hybrid-build/`` as safetensors files written
atomically; each stage leaves a manifest there, and a stage whose manifest still matches its
inputs is skipped, so an interrupted build resumes where it stopped.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid_build.calibration.fp8_block import dequantize_fp8_block, quantize_fp8_block
from hybrid_build.calibration.gptq import int8_gptq_qzeros
from hybrid_build.calibration.int8_rows import RowChunkQuantizer
from hybrid_build.calibration.metrics import error_metrics
from hybrid_build.recipes.schema import Recipe, load_recipe, select_recipe

from . import __version__
from .checkpoint import Checkpoint
from .inspection import human_bytes
from .conversion import Conversion, ConversionPlan, plan_conversion
from .errors import ArtifactError, RecipeError, SourceError, StorageError, UserError
from .progress import ProgressFactory, null_progress
from .manifest import StageManifest, describe_outputs, sha256_json
from .safetensors_io import OutTensor, ShardPlan, write_shard
from .source_identity import DIGEST_CACHE, SourceDigests, SourceRecord, record_for
from .weights import iter_row_chunks, read_tensor

log = logging.getLogger(__name__)

from .stages import STAGES, WORK_DIR  # noqa: F401  (re-exported)


@dataclass
class BuildContext:
    source: Checkpoint
    recipe: Recipe
    recipe_note: str
    out: Path
    plan: ConversionPlan
    progress: ProgressFactory = null_progress
    in_artifact: str | None = None  # the demo source: its place inside the output folder
    manifests: dict[str, StageManifest] = field(default_factory=dict)
    pending: dict[str, _Background] = field(default_factory=dict)  # stages running in the background
    deferred: list[Callable[[], None]] = field(default_factory=list)  # manifest saves waiting for the digests
    _digests: SourceDigests | None = field(default=None, repr=False)

    @property
    def work(self) -> Path:
        return self.out / WORK_DIR

    def stage_dir(self, stage: str) -> Path:
        d = self.work / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def digests(self) -> SourceDigests:
        """sha256 of every source file, from the work folder's cache or computed (``source_identity``)."""
        if self._digests is None:
            self._digests = SourceDigests(self.source.root, self.work / DIGEST_CACHE)
        return self._digests

    def fingerprint(self) -> str:
        """The source's identity by content: every stage key and the provenance use it. Waits for
        the digests if they are still being computed."""
        return self.digests.fingerprint(self.progress)

    def source_record(self) -> SourceRecord:
        return record_for(self.source.root, self.source.source_id, self.source.revision,
                          self.digests.result(self.progress), self.in_artifact)

    def assemble_marker(self) -> str:
        """Identifies an assemble in progress, so a resumed one keeps only its own complete shards.
        It uses the source files' size, mtime and inode rather than their digests, which a fresh
        build is still computing when assemble starts; the digest cache trusts the same fields."""
        stats = {f: self.digests.stat(f) for f in self.digests.files}
        return sha256_json({"tool": __version__, "source": stats,
                            "recipe": self.recipe.model_dump(mode="json", by_alias=True)})


# ---------------------------------------------------------------------------- stage inputs


def stage_inputs(ctx: BuildContext, stage: str) -> dict:
    """What a stage's result depends on; its hash is the manifest key."""
    r = ctx.recipe
    base = {"tool": __version__, "source": ctx.fingerprint()}
    if stage == "inspect":
        return base
    if stage == "calibrate":
        return {**base, "shared_experts": r.shared_experts.model_dump(mode="json"),
                "modules": [c.module for c in ctx.plan.of_kind("fp8")]}
    if stage == "quantize-head":
        return {**base, "lm_head": r.lm_head.model_dump(mode="json"), "format": r.output.format,
                "modules": [c.module for c in ctx.plan.of_kind("int8")]}
    if stage == "assemble":
        return {**base, "recipe": r.model_dump(mode="json", by_alias=True),
                "calibrate": _key(ctx, "calibrate"), "quantize-head": _key(ctx, "quantize-head")}
    if stage == "validate":
        return {"assemble": _key(ctx, "assemble"), "validate": r.validate_.model_dump(mode="json")}
    raise KeyError(stage)


def _key(ctx: BuildContext, stage: str) -> str:
    return sha256_json(stage_inputs(ctx, stage))


# ---------------------------------------------------------------------------- calibrate

FP8_FILE = "shared_experts_fp8.safetensors"
HEAD_FILE = "lm_head_int8.safetensors"
HEAD_CACHE_ROWS = 1024  # rows per quantizer step: 12 MB of float32 buffers at K = 3072


def calibrate(ctx: BuildContext) -> tuple[list[Path], dict]:
    """Shared-expert projections -> FP8 E4M3 + float32 ``weight_scale_inv`` per 128x128 block."""
    convs = ctx.plan.of_kind("fp8")
    out = ctx.stage_dir("calibrate") / FP8_FILE
    spec = ctx.recipe.shared_experts
    metrics: dict[str, dict] = {}
    if spec.source == "checkpoint":
        from .fp8_source import take_from_fp8_checkpoint

        tensors, metrics = take_from_fp8_checkpoint(ctx.source, convs, spec)
    else:
        pending: dict[str, torch.Tensor] = {}
        bar = ctx.progress(total=len(convs), desc="calibrate FP8", unit="tensor")

        def weight_bytes(c: Conversion):
            def produce():
                w = read_tensor(ctx.source, c.module + ".weight")
                q, s = quantize_fp8_block(w, observer=spec.observer)
                metrics[c.module] = error_metrics(w.float(), dequantize_fp8_block(q, s))
                pending[c.module] = s.contiguous()
                bar.update(1)
                yield q.view(torch.uint8).numpy().tobytes()
            return produce

        def scale_bytes(c: Conversion):
            def produce():
                yield pending.pop(c.module).numpy().tobytes()
            return produce

        tensors = []
        for c in convs:
            n, k = c.shape
            tensors.append(OutTensor(c.module + ".weight", "F8_E4M3", (n, k), weight_bytes(c)))
            tensors.append(OutTensor(c.module + ".weight_scale_inv", "F32",
                                     (-(-n // 128), -(-k // 128)), scale_bytes(c)))
    write_shard(ShardPlan(out.name, tensors), out.parent)
    return [out], {"metrics": metrics, "count": len(convs)}


# ---------------------------------------------------------------------------- quantize-head


def quantize_head(ctx: BuildContext) -> tuple[list[Path], dict]:
    """The ``quantize-head`` stage: write the planned head file (``head_plan``).

    In the background for ``assemble`` (``_Background``), the GPTQ tensors are also handed to
    assemble in memory as soon as they are computed, so the output shard does not wait for this
    file, and the file is written with ``O_DIRECT`` (this process will not read it back). Run on
    its own, the file goes through the page cache, where assemble finds it later."""
    bg = ctx.pending.get("quantize-head")
    handover = bg.handover if bg is not None and ctx.recipe.output.format != "compressed-tensors" else None
    plan, details = head_plan(ctx, handover)
    if plan is None:
        return [], details
    out = ctx.stage_dir("quantize-head") / plan.filename
    write_shard(plan, out.parent, direct_io=handover is not None)
    return [out], details


def head_plan(ctx: BuildContext, handover: _Handover | None = None) -> tuple[ShardPlan | None, dict]:
    """The quantize-head file as a plan: its layout is known before a byte is computed (so
    ``assemble`` can plan the output while the head is being quantized), and writing it runs
    the quantization; ``details`` receives the metrics as the producers finish. ``handover``,
    if given, receives the GPTQ tensors once computed (compressed-tensors streams its codes).

    lm-head -> int8 codes with float per-row scales, in row chunks (bounded memory).

    ``gptq-int8`` stores ``qweight`` int32 [K/4, N], which interleaves all rows, so the packed
    words are gathered in memory (N*K bytes, 763 MB for the real head) and written at the end;
    compressed-tensors' row-major int8 is streamed chunk by chunk. Chunks are at most
    ``HEAD_CACHE_ROWS`` rows (fewer if the recipe's ``chunk_rows`` says so) so that the fused
    quantizer's buffers stay in cache."""
    convs = ctx.plan.of_kind("int8")
    spec = ctx.recipe.lm_head
    if spec.storage == "bf16" or not convs:
        return None, {"storage": spec.storage, "note": "lm-head left BF16; quantized at load time by the serve plugin"}
    fmt = ctx.recipe.output.format
    details: dict = {"storage": spec.storage, "metrics": {}}
    tensors: list[OutTensor] = []
    chunk = min(spec.chunk_rows, HEAD_CACHE_ROWS)
    for c in convs:
        n, k = c.shape
        bar = ctx.progress(total=n, desc=f"quantize {c.module}", unit="row")
        if fmt == "compressed-tensors":
            # weight-only int8 is compressed-tensors "pack-quantized" at 8 bits: codes + 128, four
            # to an int32 along K. Row-major, so it streams chunk by chunk (vLLM 0.25 rejects an
            # "int-quantized" int8 weight without int8 activations).
            scales = torch.empty((n, 1), dtype=torch.float32)
            qz = RowChunkQuantizer(k, min(chunk, n), torch.float32)

            def rows(c=c, scales=scales, qz=qz, bar=bar):
                for lo, w in iter_row_chunks(ctx.source, c.module + ".weight", chunk):
                    words, s = qz(w)
                    scales[lo:lo + w.shape[0], 0] = s
                    bar.update(w.shape[0])
                    yield _raw(words)
                details["metrics"][c.module] = qz.metrics.result()

            shape = torch.tensor([n, k], dtype=torch.int64)
            tensors.append(OutTensor(c.module + ".weight_packed", "I32", (n, k // 4), rows))
            tensors.append(OutTensor(c.module + ".weight_scale", "F32", (n, 1), lambda s=scales: iter([_raw(s)])))
            tensors.append(OutTensor(c.module + ".weight_shape", "I64", (2,), lambda s=shape: iter([_raw(s)])))
        else:
            # qweight comes first in the file and interleaves all rows: its producer quantizes
            # the whole head, then the scales' producer yields what it left behind
            scales16 = torch.empty((1, n), dtype=torch.float16)
            zeros = int8_gptq_qzeros(n)

            def qweight_bytes(c=c, n=n, k=k, scales16=scales16, zeros=zeros, bar=bar):
                qweight = torch.empty((k // 4, n), dtype=torch.int32)
                qz = RowChunkQuantizer(k, min(chunk, n), torch.float16)  # GPTQ scales are fp16
                for lo, w in iter_row_chunks(ctx.source, c.module + ".weight", chunk):
                    hi = lo + w.shape[0]
                    words, s16 = qz(w)
                    for j in range(0, hi - lo, 64):  # transposed in 64-row blocks: 2.5x faster than at once
                        qweight[:, lo + j:min(hi, lo + j + 64)] = words[j:j + 64].t()
                    scales16[0, lo:hi] = s16
                    bar.update(hi - lo)
                details["metrics"][c.module] = qz.metrics.result()
                if handover is not None:
                    handover.put({c.module + ".qweight": qweight, c.module + ".qzeros": zeros,
                                  c.module + ".scales": scales16})
                yield _raw(qweight)

            tensors.append(OutTensor(c.module + ".qweight", "I32", (k // 4, n), qweight_bytes))
            tensors.append(OutTensor(c.module + ".qzeros", "I32", tuple(zeros.shape), lambda z=zeros: iter([_raw(z)])))
            tensors.append(OutTensor(c.module + ".scales", "F16", (1, n), lambda s=scales16: iter([_raw(s)])))
    return ShardPlan(HEAD_FILE, tensors), details


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (``tobytes`` would double the 763 MB packed head)."""
    return memoryview(t.contiguous().numpy()).cast("B")


# ---------------------------------------------------------------------------- runner


@dataclass
class RecipeOverrides:
    """Command-line changes to the recipe; applied before the conversion is planned."""

    format: str | None = None
    observer: str | None = None
    fp8_source: str | None = None

    def apply(self, recipe: Recipe) -> Recipe:
        recipe = recipe.model_copy(deep=True)
        if self.format:
            recipe.output.format = self.format
        if self.observer:
            recipe.shared_experts.observer = self.observer
        if self.fp8_source:
            recipe.shared_experts.source = "checkpoint"
            recipe.shared_experts.fp8_checkpoint = self.fp8_source
        return recipe


def resolve_recipe(source: Checkpoint, recipe_arg: str | None, force: bool = False,
                   how: str = "given") -> tuple[Recipe, str]:
    """The recipe to build with, and a note saying how it was chosen. A recipe given by name or
    file must fit the source's config (its ``match`` block), unless ``force``."""
    if recipe_arg:
        recipe = load_recipe(recipe_arg)
        misfit = recipe.mismatches(source.text_config, source.model_type)
        if misfit and not force:
            raise RecipeError(f"recipe {recipe.name} does not fit this source: {'; '.join(misfit)}. Leave out "
                              f"--recipe to let run choose, or pass --force to build with it anyway")
        note = f"recipe {recipe.name} ({how})" + (f"; does not fit the source ({misfit[0]}), forced" if misfit else "")
        return recipe, note
    recipe = select_recipe(source.text_config, source.model_type)
    return recipe, f"recipe {recipe.name} (chosen from the source's config.json)"


def check_output_folder(out: Path, source_root: Path) -> None:
    if out.resolve() == source_root.resolve() or source_root.resolve() in out.resolve().parents:
        raise UserError(f"{out}: the output folder must not be the source folder or inside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not (out / WORK_DIR).exists():
        raise UserError(f"{out}: exists, is not empty and is not a hybrid-build output; choose another folder")


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


def prepare(source: str | Path, out: Path, recipe_arg: str | None = None,
            progress: ProgressFactory = null_progress, revision: str | None = None,
            overrides: RecipeOverrides | None = None, force: bool = False,
            in_artifact: str | None = None, recipe_how: str = "given") -> BuildContext:
    """Open the source, pick the recipe, apply ``overrides`` and plan the conversion; nothing is
    written. ``force`` accepts a recipe whose ``match`` does not fit the source; ``in_artifact``
    marks a source that lives inside the output folder (the demo's)."""
    ckpt = Checkpoint.open(source, revision=revision)
    ckpt.require_clean()
    if ckpt.hybrid_info:
        raise SourceError(f"{source}: already a hybrid-build artifact (config.json has a hybrid_build block)")
    recipe, note = resolve_recipe(ckpt, recipe_arg, force, recipe_how)
    recipe = (overrides or RecipeOverrides()).apply(recipe)
    if in_artifact is None:
        check_output_folder(Path(out), ckpt.root)
    plan = plan_conversion(ckpt, recipe)
    if not plan.conversions:
        raise SourceError(f"{source}: recipe {recipe.name} finds nothing to convert (no BF16 shared experts or lm_head)")
    return BuildContext(ckpt, recipe, note, Path(out), plan, progress, in_artifact)


def planned_write_bytes(ctx: BuildContext) -> dict[str, int]:
    """Bytes a full build writes: the output checkpoint and the intermediate stage files."""
    source_bytes = sum(t.nbytes for t in ctx.source.tensors.values())
    head = sum(c.out_bytes for c in ctx.plan.of_kind("int8")) if ctx.recipe.lm_head.storage != "bf16" else 0
    return {"output": source_bytes - ctx.plan.bytes_before + ctx.plan.bytes_after,
            "intermediate": sum(c.out_bytes for c in ctx.plan.of_kind("fp8")) + head}


def check_free_space(ctx: BuildContext, stages: list[str]) -> None:
    """Refuse, before writing anything, a build that the output's filesystem cannot hold."""
    planned = planned_write_bytes(ctx)
    need = (planned["output"] if "assemble" in stages else 0) + planned["intermediate"]
    # files this build replaces give their space back (shards are renamed over them)
    need -= sum(p.stat().st_size for p in ctx.out.glob("*.safetensors"))
    need -= sum(p.stat().st_size for p in ctx.work.glob("*/*.safetensors"))
    free = shutil.disk_usage(ctx.out).free
    if need > free:
        raise StorageError(f"{ctx.out}: {human_bytes(free)} free on its filesystem, this build writes about "
                           f"{human_bytes(need)} (output ~{human_bytes(planned['output'])}, stage files "
                           f"~{human_bytes(planned['intermediate'])}); free some space or choose another folder")


STAGE_FUNCS: dict[str, Callable[[BuildContext], tuple[list[Path], dict]]] = {}


def _inspect_stage(ctx: BuildContext) -> tuple[list[Path], dict]:
    return [], {"conversion": ctx.plan.to_json()}


def _assemble_stage(ctx: BuildContext) -> tuple[list[Path], dict]:
    from .assemble import assemble

    return assemble(ctx)


def _validate_stage(ctx: BuildContext) -> tuple[list[Path], dict]:
    try:
        from hybrid_build.validate.report import validate_artifact
    except ImportError as e:
        raise ArtifactError(f"the validate stage is not available in this installation ({e})")
    report = validate_artifact(ctx.out, ctx.source.root, recipe=ctx.recipe, progress=ctx.progress)
    files = [p for p in (ctx.out / "hybrid_build").glob("validation.*")]
    details = {"passed": report.passed, "failures": list(getattr(report, "failures", []))}
    if not report.passed:
        raise _ValidationFailed(details)
    return files, details


class _ValidationFailed(Exception):
    def __init__(self, details: dict):
        self.details = details
        self.seconds = 0.0


STAGE_FUNCS.update({"inspect": _inspect_stage, "calibrate": calibrate, "quantize-head": quantize_head,
                    "assemble": _assemble_stage, "validate": _validate_stage})


@dataclass
class StageResult:
    stage: str
    status: str  # "ran" | "skipped" | "failed"
    seconds: float
    details: dict
    background: bool = False  # ran on a thread alongside the next stage (its seconds overlap)


def run_build(ctx: BuildContext, stages: list[str] | None = None, force: bool | list[str] = False,
              on_stage: Callable[[StageResult], None] | None = None) -> list[StageResult]:
    """Run the selected stages in order, skipping those whose manifests still match.

    ``force`` re-runs every selected stage (True) or the ones named. The source's digests are
    needed to decide whether a manifest still matches: when there are manifests to reuse they
    are computed (or read from the cache) first, otherwise on a background thread alongside the
    stages, whose manifests are then saved as soon as the digests are known.

    When both ``quantize-head`` and ``assemble`` have to run, the head is quantized on a
    background thread (compute-bound; torch releases the GIL) while ``assemble`` writes the
    shards that do not need it (I/O and hashing); the head file's layout is planned up front, and
    the writer waits for it only when it reaches the head's tensors. The head's manifest is saved
    when it finishes, as if the stages had run one after the other; if ``assemble`` fails, the
    head is still finished and recorded, so the next run resumes after it."""
    from .errors import HybridBuildError, NumericsError

    stages = stages or list(STAGES)
    forced = set(stages) if force is True else set(force or ())
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(exist_ok=True)
    check_free_space(ctx, stages)
    if not ctx.digests.ready:
        reusable = [s for s in stages if s not in forced and (ctx.work / f"{s}.json").exists()]
        if reusable:
            ctx.digests.compute(ctx.progress)
        else:
            ctx.digests.start()
    results: list[StageResult] = []

    def report(res: StageResult) -> None:
        results.append(res)
        if on_stage:
            on_stage(res)

    stage = None
    try:
        for stage in stages:
            _save_deferred(ctx, wait=False)
            if stage in ("calibrate", "quantize-head"):
                _start_head_in_background(ctx, stages, forced)  # before calibrate: it reads the source too
            if stage in ctx.pending:
                continue
            manifest = StageManifest.load(ctx.work / f"{stage}.json")
            if stage not in forced and manifest and manifest.still_valid(ctx.out, _key(ctx, stage)):
                ctx.manifests[stage] = manifest
                report(StageResult(stage, "skipped", 0.0, manifest.details))
                continue
            _require_upstream(ctx, stage)
            try:
                res = _run_stage(ctx, stage)
            except _ValidationFailed as e:
                report(StageResult(stage, "failed", e.seconds, e.details))
                raise NumericsError("validation failed: " + "; ".join(e.details["failures"][:3])
                                    + (f" (and {len(e.details['failures']) - 3} more)" if len(e.details["failures"]) > 3 else "")
                                    + f"; report in {ctx.out / 'hybrid_build' / 'validation.md'}")
            if stage == "assemble":  # the background stage reports before the one that waited for it
                for name, bg in list(ctx.pending.items()):
                    stage = name
                    report(bg.wait())
                    del ctx.pending[name]
                stage = "assemble"
            report(res)
        stage = None
        _save_deferred(ctx, wait=True)
    except (HybridBuildError, OSError) as e:
        e.stage = getattr(e, "stage", None) or stage  # for `run --json`: which stage failed
        raise
    finally:
        for bg in ctx.pending.values():
            bg.join()  # never leave a stage running behind a failure; it records its manifest itself
        ctx.pending.clear()
        _save_deferred(ctx, wait=False)  # after a failure: what finished is kept if it can be keyed
    return results


def _run_stage(ctx: BuildContext, stage: str) -> StageResult:
    t = time.perf_counter()
    try:
        paths, details = STAGE_FUNCS[stage](ctx)
    except _ValidationFailed as e:
        e.seconds = time.perf_counter() - t
        raise
    secs = time.perf_counter() - t
    hashes = details.pop("_hashes", None)
    manifest = StageManifest(stage, "", {}, describe_outputs(ctx.out, paths, hashes), details, round(secs, 3),
                             time.time())
    ctx.manifests[stage] = manifest

    def save() -> None:  # the key needs the source's digests: saved once they are known
        manifest.inputs = stage_inputs(ctx, stage)
        manifest.key = sha256_json(manifest.inputs)
        manifest.save(ctx.work / f"{stage}.json")

    if ctx.digests.ready or threading.current_thread() is not threading.main_thread():
        save()
    else:
        ctx.deferred.append(save)
    return StageResult(stage, "ran", secs, details)


def _save_deferred(ctx: BuildContext, wait: bool) -> None:
    if ctx.deferred and (wait or ctx.digests.ready):
        ctx.digests.result(ctx.progress)
        while ctx.deferred:
            ctx.deferred.pop(0)()


def _start_head_in_background(ctx: BuildContext, stages: list[str], forced: set[str]) -> None:
    """Start quantize-head on a thread if it has to run and assemble will run after it."""
    stage = "quantize-head"
    if stage in ctx.pending or stage not in stages or not _will_run(ctx, "assemble", stages, forced):
        return
    if not _will_run(ctx, stage, stages, forced):
        return
    plan, _ = head_plan(ctx)
    if plan is not None:
        ctx.pending[stage] = bg = _Background(ctx, stage, plan)
        bg.start()  # registered first: the stage looks itself up in ctx.pending


def _will_run(ctx: BuildContext, stage: str, stages: list[str], forced: set[str]) -> bool:
    if stage not in stages:
        return False
    if stage in forced:
        return True
    m = StageManifest.load(ctx.work / f"{stage}.json")
    return not (m and m.still_valid(ctx.out, _key(ctx, stage)))


class _Background:
    """One stage running on a thread; ``plan`` is the layout of the file it writes."""

    def __init__(self, ctx: BuildContext, stage: str, plan: ShardPlan) -> None:
        self.stage, self.plan = stage, plan
        self.handover = _Handover()
        self._result: StageResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ctx,), name=f"stage-{stage}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self, ctx: BuildContext) -> None:
        try:
            self._result = _run_stage(ctx, self.stage)
            self._result.background = True
        except BaseException as e:  # noqa: BLE001  (raised by wait())
            self._error = e
        finally:
            self.handover.close()

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> StageResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def ready(self) -> None:
        self.wait()

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor the stage handed over under ``name`` (once), as soon as it is computed;
        None if the stage ended without handing it over (then read its file after ``ready``)."""
        return self.handover.take(name)


class _Handover:
    """Tensors passed from a background stage to a reader in this process, each taken once."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._closed = False
        self._cond = threading.Condition()

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._tensors.update(tensors)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, name: str) -> torch.Tensor | None:
        with self._cond:
            self._cond.wait_for(lambda: name in self._tensors or self._closed)
            return self._tensors.pop(name, None)


def _require_upstream(ctx: BuildContext, stage: str) -> None:
    """A stage may only run on current results of the stages it reads."""
    needs = {"assemble": ("calibrate", "quantize-head"), "validate": ("assemble",)}.get(stage, ())
    for up in needs:
        if up in ctx.pending or up in ctx.manifests:
            continue  # ran or checked in this run, or running in the background (the stage waits for its file)
        m = StageManifest.load(ctx.work / f"{up}.json")
        if not m or not m.still_valid(ctx.out, _key(ctx, up)):
            raise UserError(f"stage {stage} needs a current {up} result; run without --only/--from, or --from {up}")
        ctx.manifests[up] = m


def stage_status(ctx: BuildContext) -> dict[str, str]:
    """For --dry-run: which stages would run and which are up to date."""
    out = {}
    for stage in STAGES:
        m = StageManifest.load(ctx.work / f"{stage}.json")
        out[stage] = "up to date" if m and m.still_valid(ctx.out, _key(ctx, stage)) else "would run"
    return out

