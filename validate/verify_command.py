"""``hybrid-build verify URL --artifact OUT``: check a running server against the artifact's reference."""
from __future__ import annotations

import argparse
from pathlib import Path

# three outcomes, three exit codes (as `validate`): could not run is neither a pass nor a failure
OUTCOME_EXIT = {"passed": 0, "failed": 1}


def register(sub, common) -> None:
    from hybrid_build.core.artifact import REPORTS
    from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag

    p = sub.add_parser(
        "verify", parents=[common], formatter_class=ExampleFormatter,
        help="check a running OpenAI-compatible server (vLLM) against the artifact's reference",
        description="Ask a running server for the prompt log-probabilities of the reference texts (/v1/completions "
                    "with prompt_logprobs, else echo + logprobs) and compare them, position by position, with "
                    f"the artifact's reference ({', '.join('ARTIFACT/' + f for f in REPORTS['reference'].files)}, "
                    "written by `hybrid-build validate`): KL(reference || server), same top-1, the actual token's "
                    "log-probability. The KL is estimated on the reference's top-k tokens with the rest of the "
                    "vocabulary lumped into one bucket: a lower bound of the full-vocabulary KL. Thresholds come "
                    "from the recipe's `verify` section. Works against any server: one `hybrid-build serve` "
                    "started, the DGX Spark docker image, a server on another machine. Speculative decoding does "
                    "not change the figures (prompt log-probabilities do not go through the drafter). Exit 0 when "
                    "the server passes, 1 when it fails, 3 when the check could not run (nothing answers, another "
                    "model is served, no prompt log-probabilities, no reference in the artifact), 2 on a usage "
                    "error (a server that refuses the API key, or wants one and got none, is one).",
        epilog="examples:\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --json\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --against source"
               "   # serving the source\n"
               "  hybrid-build verify http://spark:8000/v1 --artifact out/ --model qwen   # key: $OPENAI_API_KEY")
    p.add_argument("url", help="the server's OpenAI base URL (http://HOST:PORT/v1, or without /v1)")
    p.add_argument("--artifact", type=Path, required=True,
                   help="the artifact folder whose reference the server is checked against (a URL does not say "
                        "which artifact it serves)")
    p.add_argument("--against", choices=("hybrid", "source"), default="hybrid",
                   help="which of the reference's sides the server should match: hybrid (the artifact, default) "
                        "or source (a server of the source checkpoint: the dflash, base and mtp profiles)")
    p.add_argument("--model", help="the served model name (default: the name the artifact's recipe serves it under)")
    p.add_argument("--api-key", metavar="KEY", help="sent as a Bearer token (default: $OPENAI_API_KEY, which keeps "
                                                   "the key off the command line; `serve` says where its key is)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    add_json_flag(p)
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.core.cli_support import emit_json
    from hybrid_build.core.errors import UserError

    from .verify import render, verify_server

    if not args.url.startswith(("http://", "https://")):
        raise UserError(f"{args.url}: not an http(s) URL")
    if not args.artifact.is_dir():
        raise UserError(f"{args.artifact}: no such artifact folder")
    report = verify_server(args.url, args.artifact, side=args.against, model=args.model, api_key=args.api_key,
                           timeout=args.timeout)
    if args.json:
        emit_json(report.to_json())
    elif args.quiet:
        if report.outcome == "failed":
            print(report.verdict_line())
    else:
        print(render(report))
    return OUTCOME_EXIT[report.outcome]
