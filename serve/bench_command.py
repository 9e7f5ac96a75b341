"""``hybrid-build bench``: single-stream decode and end-to-end tokens/s of an OpenAI-compatible server."""
from __future__ import annotations

import argparse
import urllib.error

from hybrid_build.pipeline.cli_support import ExampleFormatter, add_json_flag, emit_json
from hybrid_build.pipeline.errors import ExternalToolError, UserError

from .bench import PROMPTS, bench, table


def register(sub, common) -> None:
    p = sub.add_parser(
        "bench", parents=[common], formatter_class=ExampleFormatter,
        help="measure decode and end-to-end tok/s of a running server",
        description="Single stream, temperature 0, on prose, code and tool-call prompts: decode-only tok/s "
                    "(streaming, excludes time to first token) and end-to-end tok/s (completion tokens / wall "
                    "time). Each prompt runs RUNS+1 times; the first run is discarded.",
        epilog="examples:\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --runs 3 --max-tokens 128 --json")
    p.add_argument("url", help="OpenAI base URL (ending in /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per prompt (default 5)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per request (default 256)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma list from {', '.join(PROMPTS)}")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    prompts = [s.strip() for s in args.prompts.split(",") if s.strip()]
    unknown = [s for s in prompts if s not in PROMPTS]
    if unknown:
        raise UserError(f"unknown prompt {unknown[0]!r} (choose from: {', '.join(PROMPTS)})")
    if args.runs < 1:
        raise UserError("--runs must be at least 1")
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"{args.url}: not an http(s) URL")
    try:
        report = bench(url, args.model, args.runs, args.max_tokens, prompts)
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        raise ExternalToolError(f"cannot reach {url} ({getattr(e, 'reason', e)})")
    if args.json:
        emit_json(report)
    else:
        print(table(report))
    return 0
