"""``hybrid-build run``: the whole build, or selected stages, with resume and a dry run."""
from __future__ import annotations

import argparse
import atexit
import logging
import shutil
import tempfile
import time
from pathlib import Path

from hybrid_build.core.artifact import WORK_DIR
from hybrid_build.core.byte_units import human_bytes

log = logging.getLogger(__name__)


def _split_stages(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def _demo_source(args) -> Path:
    """No SOURCE: build (once) the tiny demo checkpoint, and its drafter beside it, in the output
    folder's work dir. A demo source built before the drafter existed gets one now."""
    from hybrid_build.core.artifact import DEMO_SOURCE

    from ..generators.demo import build_demo_checkpoint, build_demo_drafter, demo_drafter_path

    path = args.out / DEMO_SOURCE
    if not (path / "model.safetensors.index.json").exists():
        if not args.quiet:
            print("no SOURCE given: building the tiny demo checkpoint (~15 s) ...", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        build_demo_checkpoint(path)
    elif not (demo_drafter_path(path) / "config.json").exists():
        build_demo_drafter(demo_drafter_path(path))
    return path


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.core.artifact import DEMO_SOURCE, REPORTS
    from hybrid_build.core.cli_support import emit_json, progress
    from hybrid_build.core.errors import UserError
    from hybrid_build.core.redaction import redact
    from hybrid_build.recipes.schema import load_recipe

    from ..build import RecipeOverrides, check_output_folder, prepare
    from ..generators.sources import SYNTHETIC_PREFIX, open_source
    from ..runner import run_build, select_stages

    t0 = time.perf_counter()  # the wall time of the whole command: the demo, opening the source, the card
    stages = select_stages(_split_stages(args.only), getattr(args, "from"))
    demo = args.source is None
    if demo:
        check_output_folder(args.out)
        if args.recipe:  # refused before the demo source is written into the output folder
            load_recipe(args.recipe)
        source = _demo_source(args)
    elif args.source.startswith(SYNTHETIC_PREFIX):
        if not args.dry_run:
            raise UserError(
                f"{args.source}: a synthetic source is headers over sparse files: only --dry-run can use it")
        workdir = tempfile.mkdtemp(prefix="hybrid-build-run-")
        atexit.register(shutil.rmtree, workdir, True)
        source = open_source(args.source, args.revision, Path(workdir))
    else:
        source = args.source

    def bar(**kw):
        return progress(args.quiet or args.json, leave=False, **kw)

    overrides = RecipeOverrides(format=args.format, observer=args.observer, fp8_source=args.fp8_source)
    ctx = prepare(source, args.out, args.recipe or ("tiny" if demo else None), progress=bar, revision=args.revision,
                  overrides=overrides, force=args.force, in_artifact=DEMO_SOURCE if demo else None,
                  recipe_how="given" if args.recipe else "the demo's")
    if not args.quiet and not args.json:
        ctx.announce = lambda line: print(f"  {line}", flush=True)
    if args.no_validate and "validate" in stages:
        stages.remove("validate")

    if args.dry_run:
        return _dry_run(args, ctx, source, stages)

    if not args.quiet and not args.json:
        print(ctx.recipe_note)

    def report(res):
        if not args.quiet and not args.json:
            extra = ""
            if res.stage == "validate" and res.status == "ran":
                extra = "  passed" if res.details.get("passed") else "  FAILED"
            diffs = [m["official_vs_local_rel_diff"] for m in res.details.get("metrics", {}).values()
                     if "official_vs_local_rel_diff" in m]
            if res.stage == "calibrate" and diffs:
                extra = (f"  official FP8 vs local calibration: mean relative difference "
                         f"{sum(diffs) / len(diffs):.4f}")
            if res.background:
                extra += "  (in the background, alongside assemble)"
            if res.reason:  # the artifact's files differ from its provenance: said, naming the file
                extra += f"  (re-run: {res.reason})"
            print(f"  {res.stage:<14} {res.status:<8} {res.seconds:7.2f} s{extra}", flush=True)

    # --force re-runs every selected stage; --from re-runs the stage it names and those after it
    force = True if args.force else (stages if getattr(args, "from") else False)
    report_path = args.out / REPORTS["validation"].named(".md")
    where = {"output": str(args.out), "recipe": ctx.recipe.name,
             "report": str(report_path) if "validate" in stages else None,
             "demo_source": str(ctx.source.root.resolve()) if demo else None}
    results = []
    try:
        results = run_build(ctx, stages, force=force, on_stage=lambda r: (results.append(r), report(r)))
    except BaseException as e:
        if args.json:  # a script gets a result object on failure too (the error line goes to stderr)
            emit_json({**where, "status": "interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                       "failed_stage": getattr(e, "stage", None), "error": redact(str(e).splitlines()[0]) if str(e)
                       else type(e).__name__, "report": str(report_path) if report_path.exists() else None,
                       "seconds": round(time.perf_counter() - t0, 3), "stages": [_stage_json(r) for r in results]})
        raise
    card = _write_card(args.out)
    if args.json:
        emit_json({**where, "status": "ok", "seconds": round(time.perf_counter() - t0, 3),
                   "card": str(card) if card else None, "stages": [_stage_json(r) for r in results]})
    elif not args.quiet:
        print(f"hybrid checkpoint in {args.out} ({time.perf_counter() - t0:.1f} s)")
        if report_path.exists() and "validate" in stages:
            print(f"validation report: {report_path}")
        if card:
            print(f"model card (what `publish` uploads as README.md): {card}")
        if demo:
            print(f"demo source (the tiny INT4 checkpoint it was built from): {ctx.source.root.resolve()}")
    return 0


def _write_card(out: Path) -> Path | None:
    """The model card, beside the build, once the build is complete; a card that cannot be made
    (a build stopped before ``record``) is left out with one log line, never a failed run."""
    from hybrid_build.core.errors import HybridBuildError

    from ..publish import write_card

    try:
        return write_card(out)
    except HybridBuildError as e:
        logging.getLogger(__name__).info("no model card written: %s", e)
        return None


def _stage_json(r) -> dict:
    return {"stage": r.stage, "status": r.status, "seconds": round(r.seconds, 3), "background": r.background,
            "reason": r.reason or None}


def _dry_run(args, ctx, source, stages: list[str]) -> int:
    from hybrid_build.core.cli_support import emit_json

    from ..runner import dry_run

    data = {"source": ctx.source.source_id or str(ctx.source.root), **dry_run(ctx, stages)}
    if args.json:
        emit_json(data)
        return 0
    print(f"{ctx.recipe_note}; output format {data['format']}")
    staged = sum(data["planned_writes"].values()) - data["output_bytes_estimate"]
    print(f"source {human_bytes(data['source_bytes'])} -> output ~{human_bytes(data['output_bytes_estimate'])} "
          f"(+ ~{human_bytes(staged)} of stage files while building)")
    for c in ctx.plan.conversions:
        print(f"  {c.kind:<5} {c.module}  {c.shape[0]}x{c.shape[1]}  "
              f"{human_bytes(c.in_bytes)} -> {human_bytes(c.out_bytes)}")
    for s in data.get("shards", []):
        print(f"  shard {s['file']}: {s['tensors']} tensors, {human_bytes(s['bytes'])}")
    for s, st in data["stages"].items():
        print(f"stage {s}: {st}")
    return 0


def _format_names() -> list[str]:
    from hybrid_build.core import formats  # torch: only when --format is given

    return formats.names()


def register(sub, common) -> None:
    from hybrid_build.core.cli_support import ExampleFormatter, LazyChoices, add_json_flag

    from ..stages import STAGES

    p = sub.add_parser(
        "run", parents=[common], formatter_class=ExampleFormatter,
        help="build the hybrid checkpoint (FP8 shared experts + int8 lm-head)",
        description="Convert an INT4 AutoRound checkpoint into the hybrid checkpoint: calibrate the BF16 shared "
                    "experts to FP8 block-128, quantize the lm-head to int8 per row, assemble the output and "
                    f"validate it. Stages leave manifests in OUT/{WORK_DIR}; running again skips finished "
                    "stages, so an interrupted run resumes. Stages: " + ", ".join(STAGES) + ".",
        epilog="examples:\n"
               "  hybrid-build run -o out/                            # tiny demo model, whole pipeline\n"
               "  hybrid-build run Intel/Qwen3.5-122B-A10B-int4-AutoRound -o hybrid/ --dry-run\n"
               "  hybrid-build run ./int4 -o hybrid/ --recipe qwen3.5-122b-a10b --format compressed-tensors\n"
               "  hybrid-build run ./int4 -o hybrid/ --from assemble   # redo assembly and validation")
    p.add_argument("source", nargs="?", help="INT4 checkpoint folder or Hub id (default: the tiny demo model)")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    p.add_argument("--recipe", help="recipe name or YAML file (default: chosen from the source's config); it must "
                                    "fit the source's config unless --force")
    p.add_argument("--revision", help="Hub revision of the source")
    p.add_argument("--dry-run", action="store_true", help="print the plan with sizes and do nothing")
    p.add_argument("--only", metavar="STAGE[,STAGE]", help="run only these stages")
    p.add_argument("--from", metavar="STAGE", help="redo this stage and the ones after it (their results are "
                                                   "recomputed even if current)")
    p.add_argument("--force", action="store_true", help="re-run stages even if their manifests match, and build "
                                                        "with a --recipe that does not fit the source")
    p.add_argument("--format", choices=LazyChoices(_format_names), metavar="FORMAT",
                   help="override the recipe's output format: inc-hybrid (auto-round layout, served through the "
                        "hybrid-build vLLM plugin) or compressed-tensors (stock vLLM loads it); docs/formats.md")
    p.add_argument("--observer", choices=["minmax", "mse"], help="override the FP8 observer")
    p.add_argument("--fp8-source", metavar="CKPT",
                   help="take the FP8 shared experts from this official FP8 checkpoint (folder or Hub id)")
    p.add_argument("--no-validate", action="store_true", help="skip the validate stage")
    add_json_flag(p)
    p.set_defaults(handler=_handle, resumes=True)  # finished stages are kept: the same command goes on

