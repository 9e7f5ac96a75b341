"""``validate_artifact``: run every check on a built artifact and write the validation report.

The report goes to ``ARTIFACT/hybrid_build/validation.{json,md,png}``: JSON for tools, Markdown for
the model card, and a plot of error per layer. A numerics or structure failure never raises: the
report says ``passed: false`` and lists one line per failure naming the tensor and the metric.
Only input that cannot be read at all (no artifact, no source) raises.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.pipeline.checkpoint import HUB_ID, Checkpoint
from hybrid_build.pipeline.conversion import plan_conversion
from hybrid_build.pipeline.errors import ArtifactError, SourceError, UserError
from hybrid_build.recipes.schema import Recipe, load_recipe, select_recipe

from . import checks
from .checks import META_DIR, Findings, ValidationInputs, exceeds

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
REPORT_FILES = ("validation.json", "validation.md", "validation.png")
CHECK_ORDER = ("index", "provenance", "tensors", "scheme", "finite", "weights", "activations", "lm_head",
               "end_to_end")


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


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

    @property
    def passed(self) -> bool:
        return not self.failures and all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return _finite_json({
            "schema_version": SCHEMA_VERSION, "passed": self.passed, "artifact": self.artifact,
            "source": self.source, "recipe": self.recipe, "format": self.format, "thresholds": self.thresholds,
            "checks": [c.to_json() for c in self.checks], "failures": self.failures, "weights": self.weights,
            "activations": self.activations, "lm_head": self.lm_head, "end_to_end": self.end_to_end,
            "seconds": round(self.seconds, 2),
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


def _resolve_source(source: Path | str | None, provenance: dict | None,
                    artifact_root: Path | None = None) -> Checkpoint:
    if source is not None:
        return Checkpoint.open(source)
    src = (provenance or {}).get("source") or {}
    ident, rev = src.get("id"), src.get("revision")
    if not ident:
        raise UserError("the artifact's provenance names no source: pass --source")
    if artifact_root is not None and not Path(ident).is_absolute() and (artifact_root / ident).is_dir():
        return Checkpoint.open(artifact_root / ident)  # the demo source lives inside the artifact
    if Path(ident).expanduser().exists() or HUB_ID.match(str(ident)):
        return Checkpoint.open(ident, revision=rev)
    raise UserError(f"the artifact was built from {ident!r}, which is neither a folder here nor a Hub id: "
                    f"pass --source")


def _resolve_recipe(artifact: Checkpoint, source: Checkpoint, f: Findings) -> Recipe:
    path = artifact.root / META_DIR / "recipe.yaml"
    if path.exists():
        return load_recipe(path)
    f.fail("provenance", f"{META_DIR}/recipe.yaml is missing; using the shipped recipe that matches the source")
    return select_recipe(source.text_config, source.model_type)


def _check_source_identity(inp: ValidationInputs, f: Findings) -> None:
    """The source must be the one the artifact was built from (file sizes, as recorded)."""
    recorded = ((inp.provenance or {}).get("source") or {}).get("files") or {}
    for name, info in sorted(recorded.items()):
        path = inp.source.root / name
        if not path.exists():
            f.fail("provenance", f"source file {name} (recorded in provenance.json) is not in the source given")
        elif info.get("bytes") is not None and path.stat().st_size != info["bytes"]:
            f.fail("provenance", f"source file {name} has {path.stat().st_size} bytes, provenance.json recorded "
                                 f"{info['bytes']}: is this the source the artifact was built from?")


# ------------------------------------------------------------------------------------- main


def validate_artifact(artifact: Path, source: Path | None = None, recipe: Recipe | None = None, progress=None,
                      *, activations: Path | None = None, e2e: bool | None = None,
                      write: bool = True) -> ValidationReport:
    """Check ``artifact`` against ``source`` (default: the one its provenance names) and write the
    report into ``artifact/hybrid_build/``. ``recipe`` defaults to the artifact's resolved recipe;
    ``e2e`` overrides the recipe's ``validate.e2e``; ``activations`` is a safetensors file of
    calibration inputs (see ``checks.load_activations``)."""
    t0 = time.perf_counter()
    progress = progress or checks.null_progress
    art = _load_artifact(Path(artifact))
    provenance = checks.read_provenance(art.root)
    src = _resolve_source(source, provenance, art.root)
    f = Findings()
    recipe = recipe or _resolve_recipe(art, src, f)
    plan = plan_conversion(src, recipe)
    inp = ValidationInputs(art, src, recipe, provenance, plan, progress, checks.load_activations(activations))
    spec = recipe.validate_
    report = ValidationReport(artifact=art.root.name, source=src.source_id or src.root.name, recipe=recipe.name,
                              format=recipe.output.format, thresholds=spec.model_dump(mode="json"))

    checks.check_index(inp, f)
    _check_source_identity(inp, f)
    checks.check_provenance(inp, f)
    checks.check_tensors(inp, f)
    checks.check_config(inp, f)
    f.details.setdefault("finite", "scales finite and positive, no NaN FP8 codes, int8 zeros symmetric")
    weights, dequantized = checks.check_fp8_weights(inp, f)
    report.activations = checks.check_activations(inp, f, dequantized)
    del dequantized
    head_entries, report.lm_head = checks.check_head(inp, f)
    report.weights = weights + head_entries
    if report.weights:
        worst = max(report.weights, key=lambda e: e["rel_error"] if e["rel_error"] == e["rel_error"] else math.inf)
        summary = (f"{len(report.weights)} converted tensors; worst relative error {worst['rel_error']:.4g} "
                   f"({worst['module']})")
        f.details["weights"] = f.details.get("weights") or summary

    run_e2e = spec.e2e if e2e is None else e2e
    if run_e2e:
        report.end_to_end = _end_to_end(inp, f)
    else:
        report.end_to_end = {"skipped": True, "reason": "validate.e2e is false in the recipe" if e2e is None
                             else "turned off for this run"}
        f.note("end_to_end", "skipped")

    for name in CHECK_ORDER:
        if name in f.details or name in f.failed:
            failed = f.failed.get(name, [])
            detail = f.details.get(name) or ""
            if failed:
                detail = f"{len(failed)} failure(s)" + (f"; {detail}" if detail else "")
            report.checks.append(CheckResult(name, not failed, detail))
    report.failures = f.failures
    report.seconds = time.perf_counter() - t0
    if write:
        report.written = [str(p) for p in write_report(report, art.root / META_DIR)]
    log.info("validation %s in %.1f s", "passed" if report.passed else "FAILED", report.seconds)
    return report


def _end_to_end(inp: ValidationInputs, f: Findings) -> dict:
    from .e2e import run_end_to_end

    spec = inp.spec
    modules = [c.module for c in inp.plan.conversions if c.kind == "fp8" or inp.head_quantized()]
    missing = [m for m in modules if not any(t.startswith(m + ".") for t in inp.artifact.tensors)]
    if missing:
        f.fail("end_to_end", f"not run: {missing[0]} has no tensors in the artifact")
        return {"skipped": True, "reason": "converted tensors missing"}
    bar = inp.progress(total=1, desc="end-to-end forward", unit="run")
    result = run_end_to_end(inp.artifact.root, inp.source.root, modules)
    checks._close(bar)
    if "error" in result:
        f.fail("end_to_end", result["error"])
        return result
    reasons = []
    if exceeds(result["kl"], spec.e2e_max_kl):
        reasons.append(f"KL {result['kl']:.4g} > {spec.e2e_max_kl} (e2e_max_kl)")
    if checks.below(result["top1_agreement"], spec.e2e_min_top1):
        reasons.append(f"top-1 agreement {result['top1_agreement']:.4f} < {spec.e2e_min_top1} (e2e_min_top1)")
    if exceeds(abs(result["ppl_change"]), spec.e2e_max_ppl_change):
        reasons.append(f"perplexity change {result['ppl_change']:+.4%} beyond ±{spec.e2e_max_ppl_change:.2%} "
                       f"(e2e_max_ppl_change)")
    for r in reasons:
        f.fail("end_to_end", r)
    result["passed"] = not reasons
    f.note("end_to_end", f"{result['tokens']} tokens: KL {result['kl']:.3g}, top-1 {result['top1_agreement']:.4f}, "
                         f"perplexity {result['ppl_source']:.4g} -> {result['ppl_hybrid']:.4g} "
                         f"({result['ppl_change']:+.3%})")
    return result


# ------------------------------------------------------------------------------------- output


def write_report(report: ValidationReport, folder: Path) -> list[Path]:
    from hybrid_build.pipeline.safetensors_io import write_text_atomic

    folder.mkdir(parents=True, exist_ok=True)
    paths = [write_text_atomic(folder / "validation.json", json.dumps(report.to_json(), indent=2) + "\n"),
             write_text_atomic(folder / "validation.md", report.to_markdown())]
    png = plot_report(report, folder / "validation.png")
    if png:
        paths.append(png)
    return paths


def _fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def render_markdown(r: ValidationReport) -> str:
    lines = [f"## Validation: {'passed' if r.passed else 'FAILED'}", "",
             f"Recipe `{r.recipe}`, format `{r.format}`, checked against source `{r.source}`.", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.detail} |" for c in r.checks]
    if r.failures:
        lines += ["", "### Failures", ""] + [f"- {line}" for line in r.failures[:50]]
        if len(r.failures) > 50:
            lines.append(f"- ... and {len(r.failures) - 50} more (validation.json lists all)")
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
        lines += [f"| {e['layer']} | {e['inputs']} | {e['tokens']} | {_fmt(e['rel_error'])} | {_fmt(e['cosine'], '.6f')} |"
                  for e in r.activations]
    if r.lm_head:
        h = r.lm_head
        lines += ["", "### lm-head logits (BF16 vs int8)", "",
                  f"{h.get('tokens')} hidden states ({h.get('inputs')}): top-1 agreement {_fmt(h.get('top1_agreement'))}, "
                  f"top-5 overlap {_fmt(h.get('top5_overlap'))}, KL {_fmt(h.get('kl'))}, "
                  f"max logit error {_fmt(h.get('max_logit_error'))}."]
    e = r.end_to_end
    lines += ["", "### End to end (teacher-forced, transformers, bundled texts)", ""]
    if e.get("skipped"):
        lines.append(f"Skipped: {e.get('reason')}.")
    elif "error" in e:
        lines.append(f"Could not run: {e['error']}.")
    else:
        lines += [f"{e['tokens']} tokens: KL(source || hybrid) {_fmt(e['kl'])}, top-1 agreement "
                  f"{_fmt(e['top1_agreement'])}, perplexity {_fmt(e['ppl_source'])} -> {_fmt(e['ppl_hybrid'])} "
                  f"({e['ppl_change']:+.3%}).", "",
                  "| text | tokens | KL | top-1 | ppl source | ppl hybrid |", "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {t['tokens']} | {_fmt(t['kl'])} | {_fmt(t['top1_agreement'])} | "
                  f"{_fmt(t['ppl_source'])} | {_fmt(t['ppl_hybrid'])} |" for name, t in e.get("texts", {}).items()]
    t = r.thresholds
    lines += ["", "Thresholds: " + ", ".join(f"{k} {v}" for k, v in t.items()) + "."]
    return "\n".join(lines) + "\n"


def plot_report(r: ValidationReport, path: Path) -> Path | None:
    """Error per layer: FP8 weight relative error per projection, worst block, and MLP output error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no validation.png (pip install 'hybrid-build[plot]')")
        return None
    fp8 = [e for e in r.weights if e["kind"] == "fp8" and e.get("layer") is not None]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    for proj, marker in (("gate_proj", "o"), ("up_proj", "s"), ("down_proj", "^")):
        pts = sorted((e["layer"], e["rel_error"]) for e in fp8 if e["module"].endswith(proj))
        if pts:
            ax.plot([p[0] for p in pts], [_plottable(p[1]) for p in pts], marker=marker, lw=1, label=f"{proj} weight")
    pts = sorted((e["layer"], e["max_block_rel_error"]) for e in fp8)
    if pts:
        ax.scatter([p[0] for p in pts], [_plottable(p[1]) for p in pts], marker="x", color="grey", label="worst block")
    acts = sorted((e["layer"], e["rel_error"]) for e in r.activations if e.get("layer") is not None)
    if acts:
        ax.plot([p[0] for p in acts], [_plottable(p[1]) for p in acts], color="black", lw=2, label="MLP output")
    t = r.thresholds
    ax.axhline(t["fp8_max_rel_error"], color="red", ls="--", lw=1, label="fp8_max_rel_error")
    ax.axhline(t["mlp_max_rel_error"], color="purple", ls=":", lw=1, label="mlp_max_rel_error")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error")
    ax.set_yscale("log")
    ax.set_title(f"{r.recipe}: FP8 shared experts vs BF16 ({'passed' if r.passed else 'FAILED'})")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".partial.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def _plottable(v: float) -> float:
    return v if isinstance(v, float) and math.isfinite(v) and v > 0 else float("nan")
