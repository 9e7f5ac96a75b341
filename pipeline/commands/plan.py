"""``hybrid-build plan``: predict decode speed per profile (one stream or several, one context or several)
before building anything.

Reads headers only (a folder, a Hub id, or ``synthetic:qwen3.5-122b-a10b``); the prediction is
``serve.speed_plan.build_plan``.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from hybrid_build.core.cli_support import (
    ACCEPTANCE,
    GB,
    GBPS,
    SHARE,
    STREAMS,
    TOKENS,
    VERIFY_POSITIONS,
    ExampleFormatter,
    add_json_flag,
    emit_json,
    float_range,
    int_range,
)
from hybrid_build.core.user_paths import check_output_path
from hybrid_build.serve.speed import bandwidth as bw
from hybrid_build.serve.speed import multinode_plan as mnp
from hybrid_build.serve.speed.memory_plan import ENGINE_VERSIONS
from hybrid_build.serve.speed.speed_plan import (
    DEFAULT_ACCEPT,
    KV_DTYPES,
    STATE_DTYPES,
    PlanOptions,
    build_plan,
    check_speculation,
    drafter_of,
    render_text,
    write_plot,
)


def _memory_budget(memory: dict, hardware: str | None) -> dict | None:
    """The start budget `serve` checks (``serve/launch/memory_budget``) for the dense profile's memory
    plan: against this machine where its GPU can be read, else against the preset's memory all free."""
    from hybrid_build.serve.launch.memory_budget import HostMemory, PlannedBytes, budget, host_memory
    from hybrid_build.serve.launch.watch import MEMORY_RESERVE_GB

    if not memory.get("total_bytes") or "kv_pool_bytes" not in memory:
        return None
    host = host_memory()
    against = "this machine"
    if host is None:
        total = memory["total_bytes"]
        host = HostMemory(hardware == "gb10", total, total, total, hardware or "")
        against = f"the {hardware} preset's {total / 1e9:.0f} GB, all of it free"
    planned = PlannedBytes(memory["weights_bytes"], memory["drafter_bytes"], memory["kv_pool_bytes"],
                           int(MEMORY_RESERVE_GB * 1e9), memory["reserve_bytes"], "the KV planner's")
    found = budget(planned, host, memory["gpu_memory_utilization"])
    return dict(found.to_json(), line=found.line(), against=against)


def _handle(args: argparse.Namespace) -> int:
    from ..generators.sources import open_source

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(PlanOptions) if hasattr(args, f.name)}
    values["contexts"] = values["context"]  # --context takes several; the first is the tables' context
    values["context"] = values["contexts"][0]
    options = PlanOptions(**values)
    check_speculation(options)  # before the checkpoint is opened: a bad --accept is said at once
    if args.plot:
        check_output_path(args.plot, "--plot", folder=False)
    with tempfile.TemporaryDirectory(prefix="hybrid-build-plan-") as tmp:
        ckpt = open_source(args.source, args.revision, Path(tmp), headers_only=True)
        data = build_plan(ckpt, options)
    data["memory_budget"] = _memory_budget(data.get("memory") or {}, data.get("hardware", {}).get("name"))
    if args.plot:
        write_plot(data, Path(args.plot), dict(
            experts=data["experts"], top_k=data["top_k"], bandwidth_gbps=data["bandwidth_gbps"],
            efficiency=data["efficiency"], drafter=drafter_of(options), context=data["context"],
            verify_positions=args.verify_block, kv_bytes=data["kv_dtype_bytes"],
            floor_ms=data["spec_step_floor_ms"]))
        data["plot"] = str(args.plot)
    if args.json:
        emit_json(data)
    else:
        print(render_text(data))
        if data["memory_budget"]:
            print(f"note: {data['memory_budget']['line']} ({data['memory_budget']['against']})")
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def register(sub, common) -> None:
    p = sub.add_parser(
        "plan", parents=[common], formatter_class=ExampleFormatter,
        help="predict decode tok/s per profile from the checkpoint's headers (bandwidth model)",
        description="Count the bytes a decoded token reads, by part, for the source (base), FP8 shared experts, "
                    "int8 lm-head and both (dense), and predict tok/s from a step time of bytes / "
                    "(bandwidth x efficiency) plus the hardware's per-step floor (time that is not bytes), with and "
                    "without speculative decoding, for one stream or several sharing each verify step "
                    "(--concurrency), at one context or several (--context). Headers only: nothing is downloaded "
                    "but headers, nothing is built. A hybrid artifact is read as the dense profile.",
        epilog="examples:\n"
               "  hybrid-build plan synthetic:qwen3.5-122b-a10b --hardware gb10 --published\n"
               "  hybrid-build plan ./Qwen3.5-122B-A10B-int4-AutoRound --accept 3 6.5 8.3 --plot plan.png\n"
               "  hybrid-build plan ./ckpt --bandwidth 1000 --calibrate 45 --json > plan.json\n"
               "  hybrid-build plan synthetic:qwen3.5-122b-a10b --concurrency 1 2 3 --accept 2.3 5.4 --profile dense "
               "--published\n"
               "  hybrid-build plan synthetic:qwen3.5-122b-a10b --hardware h200 --concurrency 1 2 4 "
               "--profile base dense --context 4096 262144 --kv-dtype fp8\n"
               "  hybrid-build plan synthetic:qwen3.5-397b-a17b --nodes 2 --accept 1   # two DGX Sparks, TP=2 / PP=2")
    p.add_argument("source", metavar="SRC_OR_ARTIFACT",
                   help="checkpoint folder, Hub id, hybrid artifact, or synthetic:qwen3.5-122b-a10b / "
                        "synthetic:qwen3.5-397b-a17b")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument("--recipe", help="recipe name or YAML file (default: chosen from config.json)")
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", choices=sorted(bw.HARDWARE), default="gb10", help="preset (default: gb10)")
    g.add_argument("--bandwidth", type=GBPS, metavar="GBPS",
                   help="peak memory bandwidth in GB/s (overrides the preset)")
    g.add_argument("--efficiency", type=float_range(0, 1, lo_open=True),
                   help="fraction of the bandwidth decode achieves (overrides the preset)")
    g.add_argument("--floor-ms", type=float_range(0, 10_000), metavar="MS",
                   help="time per decode step that is not bytes, in ms (overrides the preset's measured floor; "
                        "0: bound by bytes alone)")
    g.add_argument("--calibrate", type=float_range(0, 1e6, lo_open=True), metavar="TOK_S",
                   help="set the efficiency so that the base profile decodes at this measured tok/s")
    g = p.add_argument_group("workload")
    g.add_argument("--context", type=TOKENS, nargs="+", default=[bw.DEFAULT_CONTEXT], metavar="N",
                   help="context lengths in tokens, up to the model's max_position_embeddings; the first is the "
                        "per-token table's; several give a row set each (default: %(default)s)")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16", help="KV-cache dtype (default: bf16)")
    g.add_argument("--state-dtype", choices=list(STATE_DTYPES), default="auto",
                   help="DeltaNet state dtype (default: the config's mamba_ssm_dtype, else bf16)")
    g.add_argument("--accept", type=ACCEPTANCE, nargs="+", metavar="L",
                   help="acceptance lengths (tokens per verify step, bonus token included, so at most the "
                        "speculative tokens + 1: the DFlash drafter's block, or --verify-block; "
                        f"default: {' '.join(f'{a:g}' for a in DEFAULT_ACCEPT)})")
    g.add_argument("--concurrency", type=STREAMS, nargs="+", metavar="N",
                   help="streams sharing each verify step, each at the acceptance and context given: per-stream and "
                        "total tok/s for each count (at most 1024: the most sequences vLLM batches by default)")
    g.add_argument("--stream-overlap", type=SHARE, default=0.0, metavar="F",
                   help="share of steps in which the streams emit the same tokens, as when one prompt is sent to "
                        f"every stream at temperature 0 (default: 0, independent conversations; the seed's benchmark: "
                        f"{bw.SEED_STREAM_OVERLAP:g})")
    g.add_argument("--profile", nargs="+", choices=bw.PROFILES, metavar="P",
                   help=f"profiles whose speculative and concurrency rows are shown ({', '.join(bw.PROFILES)}; "
                        "default: all)")
    g.add_argument("--drafter", choices=["dflash", "none"], default="dflash",
                   help="drafter read per step: DFlash (1.6 GB + the target lm-head) or none (default: dflash)")
    g.add_argument("--drafter-gb", type=GB, help="drafter weight bytes in GB (default: 1.6)")
    g.add_argument("--verify-block", type=VERIFY_POSITIONS, metavar="N",
                   help="count experts over N verified positions (drafted + 1) instead of the accepted ones")
    g.add_argument("--engine", choices=ENGINE_VERSIONS, default="0.26.0",
                   help="vLLM version whose KV-cache planning the memory figures follow (default: %(default)s)")
    g.add_argument("--published", action="store_true", help="compare with the published GB10 figures of the 122B")
    g = p.add_argument_group("several nodes")
    g.add_argument("--nodes", type=int_range(2, 64), metavar="N",
                   help="also predict N nodes over a link: bytes per node, the all-reduce traffic, tok/s for TP=N and "
                        "PP=N (docs/multinode.md)")
    g.add_argument("--link-gbps", type=GBPS, default=mnp.LINK_GBPS,
                   help="link bandwidth between nodes in Gb/s (default: %(default)g, a DGX Spark's ConnectX-7)")
    g.add_argument("--link-latency-us", type=float_range(0, 1e6), default=mnp.LINK_LATENCY_US,
                   help="latency of a two-node all-reduce of a few KB in us (default: %(default)g, assumed; "
                        "measure with nccl-tests)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of tok/s against acceptance length")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
