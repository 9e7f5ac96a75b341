"""``hybrid-build validate``: check a built artifact's structure and numerics; exit 1 on failure."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _handle(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()  # the wall time printed: the whole command, the report's writing included
    from hybrid_build.core.artifact import REPORTS
    from hybrid_build.core.cli_support import emit_json, progress
    from hybrid_build.core.errors import UserError
    from hybrid_build.core.user_paths import read_text_file
    from hybrid_build.recipes.schema import load_recipe

    from .report import validate_artifact

    if args.activations is not None and not args.activations.is_file():
        raise UserError(f"{args.activations}: no such activations file")
    for texts in args.texts or []:  # refused before anything is computed or written
        read_text_file(texts, "texts file")
    recipe = load_recipe(args.recipe) if args.recipe else None

    def bar(**kw):
        return progress(args.quiet or args.json, leave=False, **kw)

    e2e = False if args.no_e2e else (True if args.e2e else None)
    announce = None if args.quiet or args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    report = validate_artifact(args.artifact, args.source, recipe=recipe, progress=bar,
                               activations=args.activations, e2e=e2e, engine=args.engine, texts=args.texts,
                               announce=announce)
    where = report.where or Path(args.artifact) / REPORTS["validation"].named(".md")
    if args.json:
        emit_json({**report.to_json(), "kept": report.kept, "report_file": str(where)})
    elif args.quiet:
        if report.outcome == "failed":  # -q keeps the one line a script or a person needs: the first failure
            print(f"validation FAILED: {_first_failure(report, where)}", file=sys.stderr)
            if report.kept:  # beside the build's passing report, which stays: say where this one is
                print(f"this run's report: {where} ({report.kept.split(';')[0]})", file=sys.stderr)
        elif report.outcome == "could not run":
            print(f"validation could not run: {_could_not_run(report)}", file=sys.stderr)
    else:
        for c in report.checks:
            print(f"  {c.name:<12} {STATE_LABELS[c.state]:<13} {c.detail}")
        for line in report.failures:
            print(f"FAIL {line}")
        saved = f"kept: {report.kept}" if report.kept else f"report in {where}"
        if report.texts is not None:  # the user's experiment: the build's report is not touched
            saved += f" (your texts; the build's report {REPORTS['validation'].main} is unchanged)"
        print(f"validation {OUTCOME_LABELS[report.outcome]} ({time.perf_counter() - t0:.1f} s); {saved}")
    return OUTCOME_EXIT[report.outcome]


# three outcomes, three exit codes: a check that could not run here is neither a pass nor a failure
OUTCOME_EXIT = {"passed": 0, "failed": 1, "could not run": 3}
OUTCOME_LABELS = {"passed": "passed", "failed": "FAILED", "could not run": "could not run"}
STATE_LABELS = {"pass": "pass", "fail": "FAIL", "skipped": "skipped", "could not run": "could not run"}


def _could_not_run(report) -> str:
    return "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.state == "could not run")


def _first_failure(report, where: Path) -> str:
    """The first failure line, and how many more there are and where they are listed."""
    lines = report.failures or [f"{c.name}: {c.detail}" for c in report.checks if not c.passed]
    more = f" (+{len(lines) - 1} more in {where})" if len(lines) > 1 else ""
    return (lines[0] if lines else "no failure line recorded") + more


def register(sub, common) -> None:
    from hybrid_build.core.artifact import META_DIR, PROVENANCE, RECIPE, REPORTS, TEXTS_REPORT_PREFIX, VALIDATION_LAST
    from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag

    p = sub.add_parser(
        "validate", parents=[common], formatter_class=ExampleFormatter,
        help="prove a built artifact's numerics and structure against its source",
        description="Check an artifact built by `hybrid-build run`: every source tensor accounted for, index and "
                    f"files agree, sha256 against {PROVENANCE}, dtypes and shapes of the declared scheme, no "
                    "NaN/Inf or non-positive scales; each converted tensor against its BF16 source (relative "
                    "error, cosine, SQNR, worst block/row); each shared-expert MLP's output; the lm-head's logits "
                    "(top-1, top-5, KL; on the forward's real hidden states when it runs); and a teacher-forced "
                    "forward of the whole model, one decoder layer at a time (KL mean, median, p99, p99.9, "
                    "same-top-1, RMS delta-p, perplexity, bootstrap intervals; per text). "
                    "Thresholds come from the recipe's `validate` section. Writes "
                    f"{', '.join('ARTIFACT/' + f for f in REPORTS['validation'].files)} (with the reference, only "
                    "when every check passed and the files still match the provenance). Exit 0 when every check "
                    "passes, 1 when one fails, 3 when a check could not run here (no vLLM, no GPU) and none failed, "
                    "2 on a usage error. A run that does not pass never replaces a passing report of the same "
                    f"build (it goes to ARTIFACT/{VALIDATION_LAST.main}), and a run that checks less (--no-e2e) "
                    "does not replace one that checked more. Top-1 agreement is judged by a one-sided binomial "
                    "bound on the positions compared (docs/validate.md).",
        epilog="examples:\n"
               f"  hybrid-build validate out/                      # source from out/{PROVENANCE}\n"
               "  hybrid-build validate out/ --source ./int4 --json\n"
               "  hybrid-build validate out/ --texts my_prompts.jsonl  # your own texts (.txt, or .jsonl name/text)\n"
               "  hybrid-build validate hybrid/ --engine vllm      # the same figures from vLLM (needs a GPU)\n"
               "  hybrid-build validate hybrid/ --no-e2e           # skip the end-to-end forward")
    p.add_argument("artifact", type=Path, help="the artifact folder written by `hybrid-build run`")
    p.add_argument("--source",
                   help=f"the INT4 source checkpoint (folder or Hub id; default: the one {PROVENANCE} names)")
    p.add_argument("--recipe", help=f"recipe name or YAML file for the thresholds (default: ARTIFACT/{RECIPE})")
    p.add_argument("--activations", type=Path, metavar="FILE",
                   help="safetensors file of calibration inputs: '<...>.mlp.shared_expert' [T, H] per layer, "
                        "'lm_head' [T, H] (default: random inputs at each layer's norm scale)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-e2e", action="store_true", help="skip the end-to-end forward even if the recipe asks for it")
    g.add_argument("--e2e", action="store_true", help="run the end-to-end forward even if the recipe turns it off")
    p.add_argument("--engine", choices=("streamed", "vllm", "transformers"), default="streamed",
                   help="how the end-to-end forward runs: streamed (default: one decoder layer in memory at a time, "
                        "GPU if torch sees one, else CPU), vllm (both models served by vLLM, needs a GPU), "
                        "transformers (the reference implementation; the model must fit in RAM)")
    p.add_argument("--texts", type=Path, action="append", metavar="FILE",
                   help="texts for the end-to-end forward instead of the bundled ones: a .txt file is one text, a "
                        ".jsonl file one {\"name\", \"text\"} object per line (repeatable). Your experiment: its "
                        f"report is ARTIFACT/{META_DIR}/{TEXTS_REPORT_PREFIX}HASH.{{json,md,png}} (HASH: the texts' "
                        "sha256), and the build's report and reference are never touched")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
