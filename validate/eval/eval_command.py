"""``hybrid-build eval``: task accuracy of the source and the hybrid with lm-evaluation-harness."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from hybrid_build.core.api_key import client_key
from hybrid_build.core.artifact import REPORTS
from hybrid_build.core.cli_support import (
    COUNT,
    POSITIVE,
    POSITIVE_INT,
    STREAMS,
    ExampleFormatter,
    add_json_flag,
    emit_json,
    progress,
)
from hybrid_build.core.errors import UserError
from hybrid_build.core.user_paths import check_output_path

EPILOG = """examples:
  hybrid-build eval out/ --limit 10                        # bundled offline tasks, source vs hybrid on CPU
  hybrid-build eval out/ --tasks hb_arith,hb_code_gen --limit 4 --json
  hybrid-build eval out/ --source-url http://localhost:8001/v1 --hybrid-url http://localhost:8000/v1
  hybrid-build eval out/ --url http://localhost:8000/v1 --source-model base --hybrid-model hybrid --tasks gsm8k

The first two run lm-eval's Hugging Face backend (small models: the source, then the source with the
artifact's converted modules dequantized into it). The others evaluate running OpenAI-compatible
servers (`hybrid-build serve` starts them; two servers, or one serving both under two names);
gsm8k and other lm-eval tasks download their data from the Hub the first time. The report goes
to %s, where `publish` puts it on the model card.
""" % " and ".join("ARTIFACT/" + f for f in REPORTS["eval"].files)


def register(sub, common) -> None:
    from hybrid_build.validate.eval.eval_names import BACKENDS, DEFAULT_TASKS

    p = sub.add_parser(
        "eval", parents=[common], formatter_class=ExampleFormatter, epilog=EPILOG,
        help="task accuracy of source and hybrid with lm-eval: recovery and a paired test",
        description="Run lm-evaluation-harness on the source and on the hybrid with the same tasks and settings, "
                    "each example logged, and report per task: both accuracies, the difference with a 95% "
                    "interval, the recovery (hybrid / source) and an exact McNemar test on the paired examples, "
                    "so that a difference within noise is called that. Tasks: any lm-eval task or group, and the "
                    "bundled offline set (hybrid_build: multiple choice; hybrid_build_gen: generative; arithmetic "
                    "word problems, code completion, tool-call JSON).")
    p.add_argument("artifact", nargs="?", type=Path, metavar="ARTIFACT",
                   help="the artifact folder (hf backend: required; servers: where the report goes, and the "
                        "tokenizer)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma list of lm-eval tasks or groups (default: hybrid_build)")
    p.add_argument("--limit", type=POSITIVE, metavar="N",
                   help="examples per task (a fraction below 1: that share of each task); default all")
    p.add_argument("--num-fewshot", type=COUNT, metavar="K", help="few-shot examples (default: each task's own)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="hf (transformers, default without a URL), completions (local-completions, default with "
                        "a URL), chat (local-chat-completions: generative tasks only)")
    g = p.add_argument_group("Hugging Face backend")
    g.add_argument("--source", help="the INT4 source checkpoint (default: the one provenance.json names, checked by "
                                    "content)")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--batch-size", type=POSITIVE_INT, default=8, help="examples per forward (default 8)")
    s = p.add_argument_group("servers")
    s.add_argument("--source-url", metavar="URL", help="OpenAI base URL (ending in /v1) serving the source")
    s.add_argument("--hybrid-url", metavar="URL", help="OpenAI base URL serving the hybrid")
    s.add_argument("--url", metavar="URL", help="one server for both (with --source-model and --hybrid-model)")
    s.add_argument("--source-model", metavar="NAME", help="served name of the source (default: the one listed)")
    s.add_argument("--hybrid-model", metavar="NAME", help="served name of the hybrid (default: the one listed)")
    s.add_argument("--tokenizer", metavar="FOLDER_OR_ID",
                   help="tokenizer for the requests (default: ARTIFACT's, else the server's /tokenize)")
    s.add_argument("--concurrency", type=STREAMS, default=4, help="requests in flight per server (default 4)")
    s.add_argument("--api-key", metavar="KEY",
                   help="sent to both servers as a Bearer token (default: $OPENAI_API_KEY, which keeps the key off "
                        "the command line); lm-eval gets it in its environment")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, metavar="FILE",
                   help=f"report JSON (a Markdown table beside it; default ARTIFACT/{REPORTS['eval'].main})")
    o.add_argument("--samples", type=Path, metavar="FILE", help="also write both runs' logged samples (JSONL)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def _settings(args):
    from hybrid_build.validate.eval.task_eval import EvalSettings

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # ranges are the argparse types' (refused before anything starts); what is left is the form
    if args.limit is not None and args.limit >= 1 and args.limit != int(args.limit):
        raise UserError("--limit is a count (a whole number) or a fraction below 1")
    urls = args.url or args.source_url or args.hybrid_url
    backend = args.backend or ("completions" if urls else "hf")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    return EvalSettings(tasks=tasks, backend=backend, limit=limit, num_fewshot=args.num_fewshot,
                        batch_size=args.batch_size, concurrency=args.concurrency, device=args.device)


def _servers(args):
    from hybrid_build.validate.eval.task_eval import ServerModel

    if args.url and (args.source_url or args.hybrid_url):
        raise UserError("--url serves both models: give it alone, or --source-url and --hybrid-url")
    src_url = args.source_url or args.url
    hyb_url = args.hybrid_url or args.url
    if not (src_url and hyb_url):
        raise UserError("a server backend needs both models: --source-url and --hybrid-url, or --url with "
                        "--source-model and --hybrid-model")
    for u in (src_url, hyb_url):
        if not u.startswith(("http://", "https://")):
            raise UserError(f"{u}: not an http(s) URL")
    if args.url and not (args.source_model and args.hybrid_model):
        raise UserError("with --url, name both served models: --source-model and --hybrid-model")
    tokenizer = args.tokenizer or (str(args.artifact) if args.artifact else None)
    return (ServerModel(src_url.rstrip("/"), args.source_model, tokenizer),
            ServerModel(hyb_url.rstrip("/"), args.hybrid_model, tokenizer))


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()  # the wall time printed: the whole command, lm-eval's import and the report included
    from hybrid_build.validate.eval import task_eval

    if args.verbose < 1:  # lm-eval warns about its own defaults on every task; -v shows it
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    settings = _settings(args)
    if args.artifact is not None and not args.artifact.is_dir():
        raise UserError(f"{args.artifact}: no such artifact folder")
    out = args.out or (task_eval.default_report_path(args.artifact) if args.artifact else None)
    if out is None:
        raise UserError("without ARTIFACT, say where the report goes: --out FILE")
    check_output_path(out, "--out" if args.out else "the report", folder=False)  # before the evaluation, not after
    if args.samples:
        check_output_path(args.samples, "--samples", folder=False)
    quiet = args.quiet or args.json

    def bar(**kw):
        return progress(quiet, leave=False, **kw)

    # a line at once, then one as each phase starts: lm-eval's import and task index, and each model's
    # loading, take tens of seconds before the first request (progress bars need a terminal)
    say = None if quiet else (lambda line: print(f"eval: {line}", file=sys.stderr, flush=True))
    if say:
        limit = f", {settings.limit} example(s) per task" if settings.limit is not None else ""
        say(f"{settings.backend} backend, tasks {', '.join(settings.tasks)}{limit}; report {out}")

    if settings.backend == "hf":
        if args.url or args.source_url or args.hybrid_url:
            raise UserError("the hf backend runs the models here: drop the URLs, or pick --backend completions/chat")
        if args.artifact is None:
            raise UserError("the hf backend needs ARTIFACT (the folder `hybrid-build run` wrote)")
        report, raw = task_eval.evaluate_artifact(args.artifact, args.source, settings, progress=bar, announce=say)
    else:
        source, hybrid = _servers(args)
        report, raw = task_eval.evaluate_endpoints(source, hybrid, settings, args.artifact, progress=bar,
                                                   api_key=client_key(args.api_key), announce=say)
    written = task_eval.write_report(report, out)
    if args.samples:
        written.append(task_eval.write_samples(raw, args.samples))
    if args.json:
        emit_json(report.to_json())
    elif not args.quiet:
        print("\n".join(task_eval.markdown_rows(report.to_json())))
        print(f"settings: {task_eval.settings_line(report.to_json())}")
        print(f"report: {', '.join(str(p) for p in written)} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0
