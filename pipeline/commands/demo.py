"""``hybrid-build demo-checkpoint DIR``: build the tiny INT4 checkpoint used as the embedded default,
and its DFlash drafter beside it (``DIR-dflash``)."""
from __future__ import annotations

import argparse
import time

from hybrid_build.core.cli_support import SEED
from hybrid_build.core.errors import UserError


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.core.user_paths import check_output_path

    from ..generators.demo import build_demo_checkpoint, demo_drafter_path

    check_output_path(args.out, "output folder", folder=True)  # a file, a loop of links: one line
    if args.out.exists() and any(args.out.iterdir()):
        raise UserError(f"{args.out}: exists and is not empty")
    drafter = demo_drafter_path(args.out)
    t = time.perf_counter()
    try:
        build_demo_checkpoint(args.out, seed=args.seed)
    except FileExistsError as e:
        from hybrid_build.core.cli_support import describe_os_error

        raise UserError(f"{describe_os_error(e)}: choose another folder") from None
    if not args.quiet:
        print(f"tiny INT4 AutoRound checkpoint written to {args.out}, its DFlash drafter to {drafter} "
              f"({time.perf_counter() - t:.1f} s)")
    return 0


def register(sub, common) -> None:
    from pathlib import Path

    from hybrid_build.core.cli_support import ExampleFormatter

    p = sub.add_parser(
        "demo-checkpoint", parents=[common], formatter_class=ExampleFormatter,
        help="build the tiny real Qwen3.5-MoE INT4 checkpoint and its DFlash drafter (offline, ~20 s)",
        description="Build a tiny random Qwen3.5-MoE with transformers, export it with auto-round RTN in "
                    "auto_round:auto_gptq format (shared experts kept BF16), re-shard it and add an MTP "
                    "tensors file outside the index, as Intel's checkpoint has. Beside it, OUT-dflash gets a "
                    "tiny random DFlash drafter (a Qwen3 with z-lab's DFlash config) for the serve profiles "
                    "that speculate with DFlash.",
        epilog="example:\n  hybrid-build demo-checkpoint ./tiny-int4       # also writes ./tiny-int4-dflash")
    p.add_argument("out", type=Path, help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=SEED, default=0, help="random seed of the weights (default 0)")
    p.set_defaults(handler=_handle)
