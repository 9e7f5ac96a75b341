"""``hybrid-build serve``: start vLLM (local or the DGX Spark docker image) for one profile."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from hybrid_build.pipeline.cli_support import ExampleFormatter, add_json_flag, emit_json, progress

from .engine import GPU_PRESETS
from .profiles import DOCKER_IMAGE, PROFILE_NAMES


def register(sub, common) -> None:
    p = sub.add_parser(
        "serve", parents=[common], formatter_class=ExampleFormatter,
        help="serve an artifact with vLLM (dense, dflash, base or mtp profile)",
        description="Start vLLM for an artifact with one of its recipe's serve profiles, wait until it is "
                    "ready, smoke-test it and print the OpenAI base URL. dense = hybrid checkpoint + int8 "
                    "lm-head + DFlash; dflash = DFlash only; base = no speculation; mtp = the model's MTP head.",
        epilog="examples:\n"
               "  hybrid-build serve out/ --profile dense --dry-run\n"
               "  hybrid-build serve out/ --profile base --port 8001\n"
               "  hybrid-build serve out/ --engine docker --profile dense   # DGX Spark image, patched vLLM 0.23")
    p.add_argument("artifact", help="artifact folder (or a Hub id, with --recipe)")
    p.add_argument("--profile", choices=PROFILE_NAMES, help="serve profile (default: the recipe's default)")
    p.add_argument("--engine", choices=("local", "docker"), default="local",
                   help="local: pip-installed vLLM with the hybrid-build plugin; docker: the sm121 image")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI-compatible server (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--recipe", help="recipe name or YAML (default: the artifact's own)")
    p.add_argument("--drafter", help="DFlash drafter Hub id or folder (overrides the profile's)")
    p.add_argument("--source", help="source checkpoint (default: the one the artifact records): the dflash/base/mtp "
                                    "profiles serve it, and a recipe's `{source}-dflash` drafter is the folder beside it")
    p.add_argument("--image", default=DOCKER_IMAGE, help="docker image (docker engine)")
    p.add_argument("--hardware", choices=sorted(dict(GPU_PRESETS).values()),
                   help="the GPU, as a `plan` preset (default: what nvidia-smi names), to say when this profile's "
                        "levers are predicted to gain little there")
    p.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for READY (default 1800)")
    p.add_argument("--log", type=Path, help="server log file (default: ./hybrid-build-serve-PROFILE.log)")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    p.add_argument("--dry-run", action="store_true", help="print the exact command and environment, start nothing")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from .engine import plan_launch
    from .launcher import check_prerequisites, smoke_test, start, wait_ready

    plan = plan_launch(args.artifact, args.profile, engine=args.engine, port=args.port, host=args.host,
                       hardware=args.hardware,
                       recipe=args.recipe, drafter=args.drafter, source=args.source, image=args.image)
    if args.dry_run:
        if args.json:
            emit_json(plan.to_json())
        else:
            for k, v in sorted(plan.env.items()):
                print(f"export {k}={v}")
            print(shlex.join(plan.argv))
            for n in plan.notes:
                print(f"# {n}")
        return 0
    check_prerequisites(plan)
    log_path = args.log or Path(f"hybrid-build-serve-{plan.profile}.log")
    server = start(plan, log_path)
    try:
        bar = progress(args.quiet, desc=f"starting vLLM ({plan.profile})", unit="s", bar_format="{desc}: {elapsed}")
        ready_s = wait_ready(server, args.ready_timeout, on_tick=lambda _t: bar.update(0))
        bar.close()
        answer = None if args.no_smoke else smoke_test(plan.base_url, plan.model_name)
        info = {"base_url": plan.base_url, "model": plan.model_name, "ready_s": round(ready_s, 1),
                "smoke_answer": answer, "pid": server.process.pid, "log": str(log_path)}
        if args.json:
            emit_json(info)
        else:
            print(f"READY in {ready_s:.0f} s   base URL: {plan.base_url}   model: {plan.model_name}")
            if answer:
                print(f"smoke test: {answer[:80]!r}")
            print("Ctrl-C stops the server.")
        sys.stdout.flush()
        while server.process.poll() is None:
            time.sleep(1)
        return 0 if server.process.returncode == 0 else 1
    except KeyboardInterrupt:
        return 130
    finally:
        server.stop()
