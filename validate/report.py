"""``validate_artifact``: run every check on a built artifact and write the validation report.

The report goes to ``ARTIFACT/hybrid_build/validation.{json,md,png}``: JSON for tools, Markdown for
the model card, and a plot of error per layer. When the streamed engine ran the end-to-end forward, the
reference (``reference``: the hybrid's own top-k log-probabilities) is written with a passing report
and only with it; the other engines record none. A numerics or structure failure never raises: the
report says ``passed: false`` and lists one line per failure naming the tensor and the metric.
Only input that cannot be read at all (no artifact, no source) raises.

Where a run's report goes (``_write``): a passing run's report and reference are written under
temporary names and renamed into place only when the artifact's files still match the provenance
(checked again at the end: the checks take minutes on a large model). A run that does not pass never
replaces a passing report of the same build, nor its reference: it goes to ``validation-last.*``
(``core.artifact.VALIDATION_LAST``), which status, serve and publish read as the latest outcome. A
run on the user's texts (``--texts``) is an experiment: its report is named by the texts' hash and
touches nothing else.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.artifact import (
    PROVENANCE,
    RECIPE,
    REPORTS,
    VALIDATION_LAST,
    Report,
    provenance_sha256,
    read_provenance,
    read_recipe_data,
    texts_report,
)
from hybrid_build.core.bounded_read import InputRefused, read_json
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.clock import utc_now
from hybrid_build.core.errors import ArtifactError, ExternalToolError, HybridBuildError, SourceError, UserError
from hybrid_build.core.integrity import check_artifact
from hybrid_build.core.manifest import sha256_json
from hybrid_build.core.provenance import Provenance
from hybrid_build.core.safetensors_io import TMP_SUFFIX
from hybrid_build.core.source_identity import open_recorded_source
from hybrid_build.recipes.conversion import plan_conversion
from hybrid_build.recipes.schema import Recipe, parse_recipe, select_recipe

from . import checks
from .checks import Findings, ValidationInputs, exceeds
from .reference import ReferenceRecorder, write_reference

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: "outcome" and each check's "state"
VALIDATION = REPORTS["validation"]  # its files, named by core.artifact
CHECK_ORDER = ("index", "provenance", "tensors", "scheme", "finite", "weights", "activations", "lm_head",
               "end_to_end")


# a check's state: it ran and passed or failed, was skipped on purpose, or the environment could not run it
RAN = ("pass", "fail")

# the picture: its size in inches and pixels per inch; a PNG of it is at most its RGBA pixels
FIGSIZE, DPI = (14, 11), 100
# the JSON and Markdown report: measured ~13 kB on the demo (13 converted tensors, 3 texts); bounds
# with room: a fixed part, each converted module's rows, each text's end-to-end rows
REPORT_FIXED_BYTES, REPORT_BYTES_PER_MODULE, REPORT_BYTES_PER_TEXT = 128_000, 8_000, 4_000


def planned_bytes(texts: dict[str, str], modules: int, e2e: bool) -> int:
    """An upper bound of what validate writes into the artifact: the report (JSON, Markdown, the
    picture) and, with the end-to-end forward, the reference. A text's tokens are bounded by its
    bytes (a token covers at least one byte; two for the special tokens) and the forward's cap."""
    from .reference import planned_bytes as reference_bytes
    from .transformers_forward import MAX_TOKENS_PER_TEXT

    width, height = FIGSIZE[0] * DPI, FIGSIZE[1] * DPI
    picture = width * height * 4 + height + 64_000  # RGBA rows, a filter byte each, chunks and metadata
    reports = REPORT_FIXED_BYTES + REPORT_BYTES_PER_MODULE * modules + REPORT_BYTES_PER_TEXT * len(texts)
    tokens = [min(MAX_TOKENS_PER_TEXT, len(t.encode("utf-8")) + 2) for t in texts.values()]
    return picture + reports + (reference_bytes(tokens) if e2e else 0)


def written_files(artifact: Path) -> list[Path]:
    """The files validate writes over (their space comes back when the new ones are renamed over)."""
    return [artifact / rel for report in (VALIDATION, REPORTS["reference"]) for rel in report.files]


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str
    state: str = "pass"  # "pass" | "fail" | "skipped" | "could not run"

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "state": self.state, "detail": self.detail}


def checks_that_ran(report_json: dict) -> set[str]:
    """The checks a report's JSON says ran (passed or failed); reports from before ``state``
    existed marked a skipped check by its detail."""
    out = set()
    for c in report_json.get("checks") or []:
        state = c.get("state") or ("fail" if not c.get("passed")
                                   else "skipped" if c.get("detail") == "skipped" else "pass")
        if state in RAN:
            out.add(c.get("name"))
    return out


@dataclass
class ValidationReport:
    artifact: str
    source: str
    recipe: str
    format: str
    thresholds: dict
    checks: list[CheckResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    weights: list[dict] = field(default_factory=list)
    activations: list[dict] = field(default_factory=list)
    lm_head: dict = field(default_factory=dict)
    end_to_end: dict = field(default_factory=dict)
    seconds: float = 0.0
    written: list[str] = field(default_factory=list)
    kept: str | None = None  # why the build's report already in the artifact was not overwritten
    provenance_sha256: str | None = None  # the build checked (core.artifact.report_state reads it)
    finished_at: str | None = None  # when the run ended, ISO 8601 UTC
    # the sha256 of each reference file this report rests on (core.bound checks them); None: no reference
    reference_sha256: dict | None = None
    texts: dict | None = None  # --texts: the user's texts (sha256, names); None: the bundled ones
    where: Path | None = None  # the Markdown report this run wrote (or the one kept)

    @property
    def passed(self) -> bool:
        """Every check that ran passed and none was left undone by the environment."""
        return self.outcome == "passed"

    @property
    def outcome(self) -> str:
        """``passed``, ``failed``, or ``could not run`` (nothing failed, but a check the run asked
        for needed an engine, a GPU or a tool that is not here): three outcomes, never merged."""
        if self.failures or any(c.state == "fail" for c in self.checks):
            return "failed"
        if any(c.state == "could not run" for c in self.checks):
            return "could not run"
        return "passed"

    def to_json(self) -> dict:
        return _finite_json({
            "schema_version": SCHEMA_VERSION, "passed": self.passed, "outcome": self.outcome, "artifact": self.artifact,
            "source": self.source, "recipe": self.recipe, "format": self.format, "thresholds": self.thresholds,
            "checks": [c.to_json() for c in self.checks], "failures": self.failures, "weights": self.weights,
            "activations": self.activations, "lm_head": self.lm_head, "end_to_end": self.end_to_end,
            "seconds": round(self.seconds, 2), "provenance_sha256": self.provenance_sha256,
            "finished_at": self.finished_at, "texts": self.texts, "reference_sha256": self.reference_sha256,
        })

    def to_markdown(self) -> str:
        return render_markdown(self)


def _finite_json(obj):
    """JSON has no NaN/Infinity: write them as the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------- inputs


def _load_artifact(artifact: Path) -> Checkpoint:
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise UserError(f"{artifact}: no such artifact folder")
    try:
        return Checkpoint.read_folder(artifact)
    except SourceError as e:  # no config.json, no shards: nothing to validate
        raise ArtifactError(f"artifact unreadable: {e}") from None


def _recipe_to_validate_with(artifact: Checkpoint, source: Checkpoint, f: Findings) -> Recipe:
    data = read_recipe_data(artifact.root, missing_ok=True)
    if data is not None:
        return parse_recipe(data, RECIPE)
    f.fail("provenance", f"{RECIPE} is missing; using the shipped recipe that matches the source")
    return select_recipe(source.text_config, source.model_type)


# ------------------------------------------------------------------------------------- main


def validate_artifact(artifact: Path, source: Path | None = None, recipe: Recipe | None = None, progress=None,
                      *, activations: Path | None = None, e2e: bool | None = None, engine: str = "streamed",
                      texts: list[Path] | None = None, announce=None, write: bool = True) -> ValidationReport:
    """Check ``artifact`` against ``source`` (default: the one its provenance names) and write the
    report into ``artifact/hybrid_build/``. ``recipe`` defaults to the artifact's resolved recipe;
    ``e2e`` overrides the recipe's ``validate.e2e`` and ``engine`` picks how the end-to-end forward
    runs (``end_to_end.ENGINES``) on ``texts`` (default: the bundled ones); ``announce`` receives
    one line saying how long the forward will take, before it starts; ``activations`` is a
    safetensors file of calibration inputs (see ``checks.load_activations``)."""
    from .end_to_end import ENGINES, load_texts

    t0 = time.perf_counter()
    progress = progress or checks.null_progress
    if engine not in ENGINES:
        raise UserError(f"unknown end-to-end engine {engine!r} (engines: {', '.join(ENGINES)})")
    texts_by_name = load_texts(texts)
    # a folder with no provenance is not a build: refused before a report is written into it
    provenance = read_provenance(Path(artifact))
    art = _load_artifact(Path(artifact))
    built = provenance_sha256(art.root)
    if write:  # refused before anything runs or is written (the source's hash cache included): a disk
        # that fills while the report or the reference is written leaves neither; the recipe's e2e is
        # not known yet, so the reference is counted unless this run turns the forward off
        from hybrid_build.core.user_paths import require_free_space

        need = planned_bytes(texts_by_name, len(provenance.converted), e2e is not False)
        require_free_space(art.root, need, "validate", replaced=written_files(art.root))
    # a source that is not, by content, the one the artifact was built from is an error before
    # any check runs: no report is written, and a passing one is never overwritten
    src = open_recorded_source(art.root, provenance, source, progress)
    f = Findings()
    recipe = recipe or _recipe_to_validate_with(art, src, f)
    plan = plan_conversion(src, recipe)
    inp = ValidationInputs(art, src, recipe, provenance, plan, progress, checks.load_activations(activations))
    spec = recipe.validate_
    run_e2e = spec.e2e if e2e is None else e2e
    report = ValidationReport(artifact=art.root.name, source=src.source_id or src.root.name, recipe=recipe.name,
                              format=recipe.output.format, thresholds=spec.model_dump(mode="json"),
                              provenance_sha256=built)

    checks.check_index(inp, f)
    checks.check_provenance(inp, f)
    checks.check_copied_files(inp, f)
    checks.check_tensors(inp, f)
    checks.check_config(inp, f)
    f.details.setdefault("finite", "scales finite and positive, no NaN FP8 codes, int8 zeros symmetric")
    weights, dequantized = checks.check_fp8_weights(inp, f)
    report.activations = checks.check_activations(inp, f, dequantized)
    del dequantized

    # the end-to-end forward first: its final-norm hidden states are the lm-head check's inputs
    recorded = None  # the streamed engine's reference.ReferenceRecorder, once its forward completed
    if run_e2e:
        report.end_to_end, recorded = _end_to_end(inp, f, engine, texts_by_name, announce)
    else:
        report.end_to_end = {"skipped": True, "reason": "validate.e2e is false in the recipe" if e2e is None
                             else "turned off for this run"}
        f.note("end_to_end", "skipped")
    head_entries, report.lm_head = checks.check_head(inp, f)
    report.weights = weights + head_entries
    if report.weights:
        worst = max(report.weights, key=lambda e: e["rel_error"] if e["rel_error"] == e["rel_error"] else math.inf)
        summary = (f"{len(report.weights)} converted tensors; worst relative error {worst['rel_error']:.4g} "
                   f"({worst['module']})")
        f.details["weights"] = f.details.get("weights") or summary

    for name in CHECK_ORDER:
        if name in f.details or name in f.failed:
            failed = f.failed.get(name, [])
            detail = f.details.get(name) or ""
            if failed:
                detail = f"{len(failed)} failure(s)" + (f"; {detail}" if detail else "")
            state = ("fail" if failed else "could not run" if name in f.could_not_run
                     else "skipped" if detail == "skipped" else "pass")
            report.checks.append(CheckResult(name, not failed, detail, state))
    report.failures = f.failures
    if texts:
        report.texts = {"sha256": sha256_json(texts_by_name), "names": list(texts_by_name)}
    report.seconds = time.perf_counter() - t0
    report.finished_at = utc_now()
    if write:
        _write(report, art.root, provenance, recorded.reference(built) if recorded is not None else None)
        from hybrid_build.core.artifact import seal_reports
        from hybrid_build.core.bound import record_validated_here

        seal_reports(art.root)  # every report now in the folder, in the provenance
        record_validated_here(art.root, report.outcome, report.texts is None)
    log.info("validation %s in %.1f s", report.outcome, report.seconds)
    return report


def _write(report: ValidationReport, artifact: Path, provenance: Provenance, reference) -> None:
    """Write ``report`` (and, with a passing report of the bundled texts, ``reference``) where it
    belongs (the module's docstring); sets ``written``, ``kept`` and ``where``."""
    if report.texts is not None:  # the user's experiment: its own name, nothing else touched
        target = texts_report(report.texts["sha256"])
        report.written = [str(p) for p in write_report(report, artifact, target)]
        report.where = artifact / target.named(".md")
        return
    if report.outcome == "passed":
        _promote_passing(report, artifact, provenance, reference)
        if report.outcome == "passed":
            return
    if _passing_report_of(artifact, report.provenance_sha256):
        report.written = [str(p) for p in write_report(report, artifact, VALIDATION_LAST)]
        report.where = artifact / VALIDATION_LAST.named(".md")
        report.kept = (f"{VALIDATION.main} of this build passed and stays, with its reference; this run "
                       f"{report.outcome}: {VALIDATION_LAST.named('.md')}")
        return
    report.written = [str(p) for p in write_report(report, artifact)]  # no passing report to keep
    report.where = artifact / VALIDATION.named(".md")


def _promote_passing(report: ValidationReport, artifact: Path, provenance: Provenance, reference) -> None:
    """A passing run: unless a stronger report of the build stays, its report and reference are
    staged under temporary names and become current only if the artifact's files still match the
    provenance now; otherwise the staged files are dropped and the run fails, naming the file."""
    report.where = artifact / VALIDATION.named(".md")
    report.kept = stronger_report(artifact, report)
    if report.kept is not None:
        return
    staged = write_reference(artifact, reference, stage=True) if reference is not None else []
    if reference is not None:  # its report passed: both describe this build; the report records its digests
        report.reference_sha256 = {tmp.name[:-len(TMP_SUFFIX)]: _sha256_of(tmp) for tmp in staged}
    staged = staged + write_report(report, artifact, stage=True)
    still = check_artifact(artifact, provenance, reports=False)  # a stat per file when nothing changed (the hash cache)
    if provenance_sha256(artifact) != report.provenance_sha256:
        still.problems.insert(0, f"{PROVENANCE} itself was replaced")
    if not still.intact:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        for line in still.problems:
            report.failures.append(f"provenance: {line} (changed while validate ran)")
        for c in report.checks:
            if c.name == "provenance":
                c.passed, c.state, c.detail = False, "fail", f"{len(still.problems)} file(s) changed while validate ran"
        return
    for tmp in staged:  # the validation JSON, which status and publish read, last
        os.replace(tmp, tmp.with_name(tmp.name[:-len(TMP_SUFFIX)]))
    report.written = [str(tmp.with_name(tmp.name[:-len(TMP_SUFFIX)])) for tmp in staged]
    for rel in VALIDATION_LAST.files:  # the latest run of this build passed
        (artifact / rel).unlink(missing_ok=True)


def _sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build_report(artifact: Path) -> dict | None:
    """The build's report in ``artifact`` as JSON (None: absent, unreadable, not a regular file)."""
    try:
        return read_json(artifact / VALIDATION.main, VALIDATION.main)
    except (OSError, InputRefused):
        return None


def _passing_report_of(artifact: Path, built: str | None) -> bool:
    """Whether the build's report in ``artifact`` passed for the build ``built``."""
    old = _build_report(artifact)
    return isinstance(old, dict) and old.get("passed") is True and bool(built) and old.get("provenance_sha256") == built


def stronger_report(artifact: Path, report: ValidationReport) -> str | None:
    """Why the passing report already in ``artifact`` stays, or None to write the passing
    ``report`` over it: a run that checked less (``--no-e2e``) never replaces a report of the same
    build that passed with more checks run. A run that did not pass never replaces a passing
    report of the same build at all (``_write``)."""
    if report.outcome != "passed":
        return None
    old = _build_report(artifact)
    if not isinstance(old, dict) or old.get("provenance_sha256") != report.provenance_sha256 or not old.get("passed"):
        return None
    ran = {c.name for c in report.checks if c.state in RAN}
    more = sorted(checks_that_ran(old) - ran)
    if not more:
        return None
    return f"{VALIDATION.main} of this build passed with more checks run ({', '.join(more)}); it is kept"


def _end_to_end(inp: ValidationInputs, f: Findings, engine: str, texts: dict[str, str],
                announce=None) -> tuple[dict, ReferenceRecorder | None]:
    """The end-to-end figures, and the reference recorder the streamed engine filled (None for
    the other engines, or when the forward did not complete)."""
    recorder = ReferenceRecorder() if engine == "streamed" else None
    result = _run_end_to_end(inp, f, engine, texts, announce, recorder)
    complete = recorder is not None and recorder.complete and not ({"error", "could_not_run", "skipped"} & set(result))
    return result, recorder if complete else None


def _run_end_to_end(inp: ValidationInputs, f: Findings, engine: str, texts: dict[str, str], announce=None,
                    recorder: ReferenceRecorder | None = None) -> dict:
    from . import end_to_end
    from .transformers_forward import run_end_to_end, strip_ansi

    spec = inp.spec
    modules = [c.module for c in inp.plan.conversions if c.kind == "fp8" or inp.head_quantized()]
    missing = [m for m in modules if not any(t.startswith(m + ".") for t in inp.artifact.tensors)]
    if missing:
        f.fail("end_to_end", f"not run: {missing[0]} has no tensors in the artifact")
        return {"skipped": True, "reason": "converted tensors missing"}
    try:
        if engine == "transformers":
            bar = inp.progress(total=1, desc="end-to-end forward", unit="run")
            result = run_end_to_end(inp.artifact.root, inp.source.root, modules)
            checks._close(bar)
            result["engine"] = "transformers"
        else:
            ids = end_to_end.tokenize(inp.source, texts)
            if announce and engine == "streamed":
                seconds, basis = end_to_end.estimate_seconds(inp.source)
                # the estimate counts the INT4 dequantization that dominates a large model; below a
                # minute the fixed costs it leaves out (loading, tokenizing, intervals) dominate
                when = ("under a minute" if seconds < 60 else f"about {seconds:.0f} s" if seconds < 120
                        else f"about {seconds / 60:.1f} min")
                announce(f"end-to-end forward ({engine}, {inp.source.text_config.get('num_hidden_layers')} layers, "
                         f"{sum(len(v) for v in ids.values())} tokens): {when} ({basis})")
            result, hidden = end_to_end.run(engine, inp.source, inp.artifact, ids, inp.progress, recorder)
            if hidden is not None and "lm_head" not in inp.activations:
                import torch

                inp.activations["lm_head"] = torch.cat([h for h in hidden.values()])
                inp.activation_labels["lm_head"] = "real (final-norm hidden states of the end-to-end forward)"
    except ExternalToolError as e:  # no vLLM, no GPU, an engine that did not start: not a failed check
        why = " ".join(strip_ansi(str(e)).split())
        f.cannot_run("end_to_end", why)
        return {"could_not_run": why, "engine": engine}
    except HybridBuildError as e:  # no tokenizer, texts too short: one sentence
        result = {"error": str(e), "engine": engine}
    if "error" in result:
        # one sentence, as the engine explained it; a terminal's colour codes never reach the report
        result["error"] = " ".join(strip_ansi(result["error"]).split())
        f.fail("end_to_end", result["error"])
        return result
    reasons = []
    if exceeds(result["kl"], spec.e2e_max_kl):
        reasons.append(f"KL {result['kl']:.4g} > {spec.e2e_max_kl} (e2e_max_kl)")
    top1 = checks.rate_test(result["top1_agreement"], int(result["tokens"]), spec.e2e_min_top1)
    result["top1_test"] = top1.to_json()
    if top1.fails:  # a binomial bound on the positions compared, not the bare rate (checks.RateTest)
        reasons.append(top1.reason("top-1 agreement", "e2e_min_top1"))
    if exceeds(abs(result["ppl_change"]), spec.e2e_max_ppl_change):
        reasons.append(f"perplexity change {result['ppl_change']:+.4%} beyond ±{spec.e2e_max_ppl_change:.2%} "
                       f"(e2e_max_ppl_change)")
    for r in reasons:
        f.fail("end_to_end", r)
    result["passed"] = not reasons
    f.note("end_to_end", f"{result['tokens']} tokens: KL {result['kl']:.3g}, top-1 {result['top1_agreement']:.4f} "
                         f"({top1.note()}), "
                         f"perplexity {result['ppl_source']:.4g} -> {result['ppl_hybrid']:.4g} "
                         f"({result['ppl_change']:+.3%})")
    return result


# ------------------------------------------------------------------------------------- output


def write_report(report: ValidationReport, artifact: Path, target: Report = VALIDATION,
                 stage: bool = False) -> list[Path]:
    """The report's files in ``artifact`` under ``target``'s names (``core.artifact`` names them),
    each written whole; ``stage``: under temporary names (``TMP_SUFFIX`` added), left for the
    caller to rename, the JSON last in the list."""
    from hybrid_build.core.safetensors_io import write_text_atomic

    def at(suffix: str) -> Path:
        path = artifact / target.named(suffix)
        return path.with_name(path.name + TMP_SUFFIX) if stage else path

    (artifact / target.main).parent.mkdir(parents=True, exist_ok=True)
    png = plot_report(report, at(".png"))
    paths = [png] if png else []
    paths += [write_text_atomic(at(".md"), report.to_markdown()),
              write_text_atomic(at(".json"), json.dumps(report.to_json(), indent=2) + "\n")]
    return paths


def _fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_markdown(r: ValidationReport) -> str:
    lines = [f"## Validation: {'passed' if r.passed else 'FAILED'}", "",
             f"Recipe `{r.recipe}`, format `{r.format}`, checked against source `{r.source}`.", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {_cell(c.detail)} |" for c in r.checks]
    if r.failures:
        lines += ["", "### Failures", ""] + [f"- {line}" for line in r.failures[:50]]
        if len(r.failures) > 50:
            lines.append(f"- ... and {len(r.failures) - 50} more ({REPORTS['validation'].main} lists all)")
    if r.weights:
        lines += ["", "### Converted weights (dequantized vs BF16 source)", "",
                  "| module | kind | rel. error | cosine | SQNR dB | max abs error | worst block/row |",
                  "|---|---|---|---|---|---|---|"]
        for e in r.weights:
            worst = e.get("max_block_rel_error", e.get("max_row_rel_error"))
            lines.append(f"| `{e['module']}` | {e['kind']} | {_fmt(e['rel_error'])} | {_fmt(e['cosine'], '.6f')} | "
                         f"{_fmt(e['sqnr_db'], '.2f')} | {_fmt(e['max_abs_error'])} | {_fmt(worst)} |")
    if r.activations:
        lines += ["", "### Shared-expert MLP outputs (same inputs, source vs converted weights)", "",
                  "| layer | inputs | tokens | rel. error | cosine |", "|---|---|---|---|---|"]
        lines += [f"| {e['layer']} | {e['inputs']} | {e['tokens']} | {_fmt(e['rel_error'])} | "
                  f"{_fmt(e['cosine'], '.6f')} |" for e in r.activations]
    if r.lm_head:
        h = r.lm_head
        lines += ["", "### lm-head logits (BF16 vs int8)", "",
                  f"{h.get('tokens')} hidden states ({h.get('inputs')}): "
                  f"top-1 agreement {_fmt(h.get('top1_agreement'))}, "
                  f"top-5 overlap {_fmt(h.get('top5_overlap'))}, KL {_fmt(h.get('kl'))}, "
                  f"max logit error {_fmt(h.get('max_logit_error'))}."]
    e = r.end_to_end
    engine = e.get("engine", "streamed")
    lines += ["", f"### End to end (teacher-forced, {engine} engine, KL(source || hybrid) per position)", ""]
    if e.get("skipped"):
        lines.append(f"Skipped: {e.get('reason')}.")
    elif "could_not_run" in e:  # the environment, not the artifact: neither passed nor failed
        lines.append(f"Could not run here: {e['could_not_run'].rstrip('.')}.")
    elif "error" in e:  # a failed check: the forward could not be made on this artifact and these texts
        lines.append(f"Failed to run: {e['error'].rstrip('.')}.")
    else:
        lines += [f"{e['tokens']} tokens: KL(source || hybrid) {_fmt(e['kl'])}, top-1 agreement "
                  f"{_fmt(e['top1_agreement'])}, perplexity {_fmt(e['ppl_source'])} -> {_fmt(e['ppl_hybrid'])} "
                  f"({e['ppl_change']:+.3%}).", ""]
        full = "kl_p99" in e  # the streamed and vllm engines report the whole distribution
        if full:
            lines += ["| text | tokens | mean KL [95% CI] | median KL | p99 KL | p99.9 KL | same top-1 [95% CI] | "
                      "RMS Δp | ppl source | ppl hybrid |", "|---|---|---|---|---|---|---|---|---|---|"]
            rows = {**e.get("texts", {}), "all": e}
            lines += [f"| {name} | {t['tokens']} | {_fmt(t['kl'])} "
                      f"[{_fmt(t['kl_ci95'][0])}, {_fmt(t['kl_ci95'][1])}] | "
                      f"{_fmt(t['kl_median'])} | {_fmt(t['kl_p99'])} | {_fmt(t['kl_p999'])} | "
                      f"{_fmt(t['top1_agreement'])} [{_fmt(t['top1_ci95'][0])}, {_fmt(t['top1_ci95'][1])}] | "
                      f"{_fmt(t['rms_delta_p'])} | {_fmt(t['ppl_source'])} | {_fmt(t['ppl_hybrid'])} |"
                      for name, t in rows.items()]
        else:
            lines += ["| text | tokens | KL | top-1 | ppl source | ppl hybrid |", "|---|---|---|---|---|---|"]
            lines += [f"| {name} | {t['tokens']} | {_fmt(t['kl'])} | {_fmt(t['top1_agreement'])} | "
                      f"{_fmt(t['ppl_source'])} | {_fmt(t['ppl_hybrid'])} |" for name, t in e.get("texts", {}).items()]
    t = r.thresholds
    lines += ["", "Thresholds: " + ", ".join(f"{k} {v}" for k, v in t.items()) + "."]
    return "\n".join(lines) + "\n"


def plot_report(r: ValidationReport, path: Path) -> Path | None:
    """Write ``render_figure(r)`` as a PNG; ``None`` (and a warning) when matplotlib is missing."""
    try:
        fig = render_figure(r)
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install 'hybrid-build[plot]')",
                    REPORTS["validation"].named(".png"))
        return None
    tmp = path.with_name(path.name + ".partial.png")
    try:
        fig.savefig(tmp)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial picture behind
        raise
    return path


# A panel's title says PASS or FAIL in these colours; failing points get a red ring.
PASS_COLOR, FAIL_COLOR, NONE_COLOR = "#1a7f37", "#cf222e", "#6e7781"
# red and green mean FAIL and PASS: the series take other colours, thresholds are dashed
PROJ_STYLE = {"gate_proj": ("o", "#0969da"), "up_proj": ("s", "#bc4c00"), "down_proj": ("^", "#8250df")}
METRIC_COLORS = ("#0969da", "#8250df", "#bc4c00")


def render_figure(r: ValidationReport):
    """The validation picture as a matplotlib ``Figure`` (nothing written; ``plot_report`` saves it).

    One row per part of the check, one panel per metric, each drawn against its own threshold
    from the recipe (a dashed line whose ``gid`` is ``threshold:<name>``): the FP8 shared experts
    per layer (weight relative error, worst 128x128 block, MLP output), the int8 lm-head (weight
    error, top-1 and top-5 agreement, logit KL) and the end-to-end forward (top-1, KL, perplexity
    change, per text and over all tokens). A part with nothing to draw (skipped, could not run,
    not converted) is one panel across its row saying why. Each panel's title says PASS or FAIL for
    what it draws, failing points are ringed in red, and the figure's title is the whole report's
    verdict. Uses ``matplotlib.figure.Figure`` directly: no pyplot state, no backend switch.
    Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    t = r.thresholds
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(3, 3)
    verdict = "passed" if r.passed else \
        f"FAILED ({len(r.failures)} failure(s): see {REPORTS['validation'].named('.md')})"
    fig.suptitle(f"{r.recipe} ({r.format}): validation {verdict}", fontsize=14, fontweight="bold",
                 color=PASS_COLOR if r.passed else FAIL_COLOR)

    def row(i: int, title: str, drawable: bool, why: str, color: str = NONE_COLOR, status: str = "no data"):
        if drawable:
            return [fig.add_subplot(grid[i, col]) for col in range(3)]
        _note_panel(fig.add_subplot(grid[i, :]), title, why, color, status, width=110)
        return None

    fp8 = [e for e in r.weights if e["kind"] == "fp8" and e.get("layer") is not None]
    acts = sorted((e["layer"], e["rel_error"]) for e in r.activations if e.get("layer") is not None)
    axes = row(0, "FP8 shared experts", bool(fp8 or acts), "no FP8 shared experts in this artifact")
    if axes:
        by_proj = {proj: sorted(((e["layer"], e) for e in fp8 if e["module"].endswith(proj)), key=lambda p: p[0])
                   for proj in PROJ_STYLE}
        _layer_panel(axes[0], "FP8 shared-expert weights: relative error",
                     {proj: [(layer, e["rel_error"]) for layer, e in pts] for proj, pts in by_proj.items()},
                     "fp8_max_rel_error", t)
        _layer_panel(axes[1], "FP8 weights: worst 128x128 block",
                     {proj: [(layer, e["max_block_rel_error"]) for layer, e in pts] for proj, pts in by_proj.items()},
                     "fp8_max_block_rel_error", t)
        _layer_panel(axes[2], "shared-expert MLP output: relative error", {"MLP output": acts},
                     "mlp_max_rel_error", t)

    head = next((e for e in r.weights if e["kind"] == "int8"), None) or {}
    h = r.lm_head
    axes = row(1, "lm-head", bool(head or h), "the lm-head is not converted to int8 (or its tensors are missing)")
    if axes:
        _metric_panel(axes[0], "lm-head int8 weight: relative error",
                      [("tensor", head.get("rel_error"), "int8_max_rel_error"),
                       ("worst row", head.get("max_row_rel_error"), "int8_max_row_rel_error")], t, log_scale=True)
        _metric_panel(axes[1], "lm-head logits: agreement with BF16",
                      [("top-1", h.get("top1_agreement"), "head_min_top1"),
                       ("top-5 overlap", h.get("top5_overlap"), "head_min_top5_overlap")], t, lower_bound=True,
                      verdicts=_rate_verdicts(h, "head_min_top1"))
        _metric_panel(axes[2], "lm-head logits: KL(BF16 || int8)", [("mean", h.get("kl"), "head_max_kl")], t,
                      log_scale=True)

    e = r.end_to_end
    failed, undone = "error" in e, "could_not_run" in e
    axes = row(2, "end to end (teacher-forced forward, transformers)", not (e.get("skipped") or failed or undone),
               f"failed to run: {e.get('error')}" if failed else f"could not run here: {e['could_not_run']}" if undone
               else f"skipped: {e.get('reason')}",
               FAIL_COLOR if failed else NONE_COLOR, "FAIL" if failed else "could not run" if undone else "skipped")
    if axes:
        texts = e.get("texts", {})
        _text_panel(axes[0], "end to end: top-1 agreement",
                    [(n, x["top1_agreement"]) for n, x in texts.items()], e["top1_agreement"], "e2e_min_top1", t,
                    lower_bound=True, verdict=_rate_verdicts(e, "e2e_min_top1").get("e2e_min_top1"))
        _text_panel(axes[1], "end to end: KL(source || hybrid)",
                    [(n, x["kl"]) for n, x in texts.items()], e["kl"], "e2e_max_kl", t, log_scale=True)
        _text_panel(axes[2], "end to end: perplexity change",
                    [(n, x["ppl_hybrid"] / x["ppl_source"] - 1.0) for n, x in texts.items()], e["ppl_change"],
                    "e2e_max_ppl_change", t, symmetric=True)
    return fig


def _rate_verdicts(part: dict, name: str) -> dict[str, bool]:
    """A rate judged by its binomial test (``checks.RateTest``): the picture says what the check said."""
    test = part.get("top1_test")
    return {name: bool(test["fails"])} if isinstance(test, dict) and "fails" in test else {}


def _fails(value, limit: float, lower_bound: bool = False, symmetric: bool = False) -> bool:
    """The checks' own NaN-safe comparisons: a NaN fails."""
    if symmetric:
        value = abs(value)
    return checks.below(value, limit) if lower_bound else exceeds(value, limit)


def _title(ax, title: str, status: str, color: str) -> None:
    ax.set_title(f"{title}\n{status}", fontsize=10, color=color, fontweight="bold")


def _threshold(ax, name: str, value: float, color: str = "black", xmin: float = 0.0, xmax: float = 1.0):
    """A dashed horizontal line at ``value``, labelled and tagged ``threshold:<name>``."""
    line = ax.axhline(value, xmin=xmin, xmax=xmax, color=color, ls="--", lw=1.3, label=f"{name} = {value:g}")
    line.set_gid(f"threshold:{name}")
    return line


def _mark_failures(ax, xs: list, ys: list) -> None:
    """Red rings around failing points; a non-finite one sits on the top edge as a red triangle."""
    from matplotlib.transforms import blended_transform_factory

    finite = [(x, y) for x, y in zip(xs, ys) if _finite(y)]
    if finite:
        ax.scatter([p[0] for p in finite], [p[1] for p in finite], s=180, facecolors="none",
                   edgecolors=FAIL_COLOR, linewidths=2, zorder=5, gid="failed", label="over the threshold")
    bad = [x for x, y in zip(xs, ys) if not _finite(y)]
    if bad:
        ax.scatter(bad, [1.0] * len(bad), marker="v", s=90, color=FAIL_COLOR, clip_on=False, zorder=5, gid="failed",
                   transform=blended_transform_factory(ax.transData, ax.transAxes), label="NaN / Inf")


def _finish_scale(ax, values: list, limits: list[float], log_scale: bool) -> None:
    vals = [v for v in values if _finite(v)] + list(limits)
    if log_scale and vals and min(vals) > 0 and max(vals) / min(vals) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=min(0.0, *vals) * 1.1 if vals else 0.0)


def _layer_panel(ax, title: str, series: dict[str, list[tuple[int, float]]], name: str, t: dict) -> None:
    """Per-layer lines (integer layer ticks), one threshold, failing layers ringed."""
    from matplotlib.ticker import MaxNLocator

    series = {label: pts for label, pts in series.items() if pts}
    if not series:
        _note_panel(ax, title, "no FP8 shared experts in this artifact", NONE_COLOR, "no data")
        return
    limit = t[name]
    fail_x, fail_y, values = [], [], []
    for label, pts in series.items():
        marker, color = PROJ_STYLE.get(label, ("o", "black"))
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, [_plottable(y) for y in ys], marker=marker, color=color, lw=1.2, label=label)
        values += ys
        for x, y in pts:
            if _fails(y, limit):
                fail_x.append(x)
                fail_y.append(y)
    _threshold(ax, name, limit)
    _mark_failures(ax, fail_x, fail_y)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    _finish_scale(ax, values, [limit], log_scale=True)
    _title(ax, title, f"FAIL: {len(set(fail_x))} layer(s) over {name}" if fail_x else f"PASS (<= {limit:g})",
           FAIL_COLOR if fail_x else PASS_COLOR)
    _legend_below(ax, below_label=True)


def _metric_panel(ax, title: str, metrics: list[tuple[str, float | None, str]], t: dict, *,
                  lower_bound: bool = False, log_scale: bool = False, verdicts: dict[str, bool] | None = None) -> None:
    """One point per metric, each with its own threshold as a short dashed segment of its colour;
    ``verdicts`` (threshold name -> fails) where the check judged by more than the bare value."""
    metrics = [m for m in metrics if m[1] is not None]
    if not metrics:
        _note_panel(ax, title, "not measured", NONE_COLOR, "no data")
        return
    failed = []
    for i, (label, value, name) in enumerate(metrics):
        color = METRIC_COLORS[i % len(METRIC_COLORS)]
        ax.plot([i], [_plottable(value, lower_bound)], "o", ms=10, color=color, label=f"{label}: {value:.4g}")
        span = 1.0 / len(metrics)
        _threshold(ax, name, t[name], color=color, xmin=i * span + 0.1 * span, xmax=(i + 1) * span - 0.1 * span)
        if (verdicts or {}).get(name, _fails(value, t[name], lower_bound)):
            failed.append(label)
            _mark_failures(ax, [i], [value])
    ax.set_xlim(-0.5, len(metrics) - 0.5)
    ax.set_xticks(range(len(metrics)), [m[0] for m in metrics])
    _finish_scale(ax, [m[1] for m in metrics], [t[m[2]] for m in metrics], log_scale)
    if lower_bound:
        _zoom_to_bounds(ax, [m[1] for m in metrics], [t[m[2]] for m in metrics])
    bound = "<" if lower_bound else ">"
    _title(ax, title, f"FAIL: {', '.join(failed)} {bound} threshold" if failed else "PASS",
           FAIL_COLOR if failed else PASS_COLOR)
    _legend_below(ax)


def _text_panel(ax, title: str, per_text: list[tuple[str, float]], overall: float, name: str, t: dict, *,
                lower_bound: bool = False, log_scale: bool = False, symmetric: bool = False,
                verdict: bool | None = None) -> None:
    """The end-to-end figure per bundled text (grey, for reading only) and over all tokens (the
    value the check compares), against the threshold."""
    limit = t[name]
    labels = [n for n, _ in per_text] + ["all"]
    xs = list(range(len(labels)))
    ax.plot(xs[:-1], [_plottable(v, lower_bound or symmetric) for _, v in per_text], "o", ms=7, color=NONE_COLOR,
            label="per text")
    failed = _fails(overall, limit, lower_bound, symmetric) if verdict is None else verdict
    ax.plot([xs[-1]], [_plottable(overall, lower_bound or symmetric)], "D", ms=10,
            color=FAIL_COLOR if failed else PASS_COLOR, label=f"all tokens: {overall:.4g}")
    _threshold(ax, name, limit, color="black")
    if symmetric:
        _threshold(ax, name, -limit, color="black").set_label(f"-{name}")
        ax.axhline(0.0, color=NONE_COLOR, lw=0.6)
    if failed:
        _mark_failures(ax, [xs[-1]], [overall])
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xticks(xs, labels)
    values = [v for _, v in per_text] + [overall]
    if symmetric:
        top = max([abs(v) for v in values if _finite(v)] + [limit]) * 1.2
        ax.set_ylim(-top, top)
    else:
        _finish_scale(ax, values, [limit], log_scale)
    if lower_bound:
        _zoom_to_bounds(ax, values, [limit])
    _title(ax, title, f"FAIL: {overall:.4g} vs {name} {limit:g}" if failed else "PASS",
           FAIL_COLOR if failed else PASS_COLOR)
    _legend_below(ax)


def _zoom_to_bounds(ax, values: list, limits: list[float]) -> None:
    """Agreement figures live near 1: show from a little under the lowest value or bound up to 1."""
    vals = [v for v in values if _finite(v)] + list(limits)
    low = min(vals)
    ax.set_ylim(max(0.0, low - 0.1 * (1.0 - low + 0.05)), 1.0 + 0.02 * (1.0 - low + 0.05))


def _note_panel(ax, title: str, text: str, color: str, status: str, width: int = 48) -> None:
    """A panel with nothing to draw: the reason, wrapped, in place of axes."""
    import textwrap

    ax.set_axis_off()
    ax.text(0.5, 0.5, textwrap.fill(text, width), ha="center", va="center", transform=ax.transAxes, fontsize=10,
            color=color)
    _title(ax, title, status, color)


def _legend_below(ax, below_label: bool = False) -> None:
    """The legend goes under the axes (and under the x label), never over the lines."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2 if below_label else -0.12), ncol=2, fontsize=7,
              frameon=False)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _plottable(v, allow_nonpositive: bool = False) -> float:
    """NaN (not drawn) for what a log axis cannot show; the checks still count a NaN as failed."""
    if not _finite(v):
        return float("nan")
    return float(v) if allow_nonpositive or v > 0 else float("nan")
