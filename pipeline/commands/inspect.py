"""``hybrid-build inspect``: what a checkpoint holds and what a decoded token reads."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag, emit_json
from hybrid_build.core.errors import SourceError


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.recipes.inventory import build_report, render_text  # torch: only when the command runs

    from ..generators.sources import open_source

    with tempfile.TemporaryDirectory(prefix="hybrid-build-inspect-") as tmp:
        ckpt = open_source(args.source, args.revision, Path(tmp), require_clean=False, headers_only=True)
        report = build_report(ckpt, args.recipe)
    data = report.to_json()
    if args.json:
        emit_json(data)
    else:
        print(render_text(data))
    errors = ckpt.errors()
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SourceError(errors[0].message + more)
    return 0


def register(sub, common) -> None:
    p = sub.add_parser(
        "inspect", parents=[common], formatter_class=ExampleFormatter,
        help="show what a checkpoint holds and what a decoded token reads (headers only)",
        description="Classify every tensor of a checkpoint (folder or Hub id) from its safetensors headers, "
                    "count bytes per class and per decoded token, show the conversion the recipe would make, "
                    "and flag problems (missing shards, duplicate tensors, bad packing, truncated headers).",
        epilog="examples:\n"
               "  hybrid-build inspect ./Qwen3.5-122B-A10B-int4-AutoRound\n"
               "  hybrid-build inspect Intel/Qwen3.5-122B-A10B-int4-AutoRound --json > inspect.json\n"
               "  hybrid-build inspect ./ckpt --recipe tiny")
    p.add_argument("source", help="checkpoint folder, Hub id, or synthetic:NAME (a model's real layout, headers only)")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument("--recipe", help="recipe name or YAML file for the conversion preview (default: chosen from config)")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
