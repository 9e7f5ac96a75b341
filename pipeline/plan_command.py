"""``hybrid-build plan``: predict single-stream decode speed per profile before building anything.

Reads headers only (a folder, a Hub id, or ``synthetic:qwen3.5-122b-a10b``, the real 122B's
layout written as sparse files), sizes the four profiles with the same recipe and conversion
plan ``inspect`` and ``run`` use, and applies the bandwidth model of ``bandwidth``. The JSON
schema and the model's assumptions are in docs/plan.md.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from . import bandwidth as bw
from .checkpoint import Checkpoint
from .errors import UserError
from .inspection import build_report, bytes_per_token

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_ACCEPT = (2.0, 4.0, 6.0, 8.0, 10.0)
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1}
STATE_DTYPES = {"auto": None, "bf16": 2, "fp32": 4}


def _synthetic_models() -> dict:
    from .synthetic import qwen35_122b_config

    # compact extra_config: same meaning, and reading 112k headers takes seconds instead of ~30 s
    return {"qwen3.5-122b-a10b": lambda: qwen35_122b_config(compact_extra_config=True)}


def open_checkpoint(source: str, revision: str | None, workdir: Path) -> Checkpoint:
    """A checkpoint from a folder or Hub id; ``synthetic:NAME`` writes NAME's sparse headers first."""
    if source.startswith(SYNTHETIC_PREFIX):
        from .synthetic import write_synthetic_checkpoint

        name = source[len(SYNTHETIC_PREFIX):]
        models = _synthetic_models()
        if name not in models:
            raise UserError(f"{source}: unknown synthetic model (known: {', '.join(SYNTHETIC_PREFIX + m for m in models)})")
        folder = write_synthetic_checkpoint(workdir / name, models[name](), sparse=True)
        ckpt = Checkpoint.read_folder(folder, source_id=source)
    else:
        ckpt = Checkpoint.open(source, revision=revision)
    ckpt.require_clean()
    return ckpt


def _is_hybrid(ckpt: Checkpoint) -> bool:
    return bool(ckpt.hybrid_info) or any(
        (t.klass == "shared_expert" and t.storage == "fp8") or (t.klass == "lm_head" and t.storage == "int8")
        for t in ckpt.tensors.values())


def _hardware(args: argparse.Namespace) -> bw.Hardware:
    preset = bw.HARDWARE[args.hardware]
    if args.bandwidth is not None:
        if not args.bandwidth > 0:
            raise UserError(f"--bandwidth must be positive, got {args.bandwidth}")
        preset = bw.Hardware("custom", f"custom ({args.bandwidth:g} GB/s)", args.bandwidth, preset.efficiency,
                             f"{preset.name}'s efficiency ({preset.calibration})", False)
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise UserError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        preset = bw.Hardware(preset.name, preset.label, preset.bandwidth_gbps, args.efficiency, "given (--efficiency)", False)
    return preset


def _drafter(args: argparse.Namespace) -> bw.Drafter:
    if args.drafter == "none":
        return bw.NO_DRAFTER
    d = bw.DFLASH_122B
    if args.drafter_gb is not None:
        if args.drafter_gb < 0:
            raise UserError(f"--drafter-gb must be >= 0, got {args.drafter_gb}")
        d = bw.Drafter(d.name, int(args.drafter_gb * 1e9), d.kv_bytes_per_position, d.full_layers,
                       d.sliding_layers, d.window, d.shares_lm_head)
    return d


def build_plan(ckpt: Checkpoint, args: argparse.Namespace) -> dict:
    """Everything ``plan`` prints, as the JSON document of docs/plan.md."""
    accepts = list(args.accept) if args.accept else list(DEFAULT_ACCEPT)
    for a in accepts:
        if not a >= 1:
            raise UserError(f"--accept {a:g}: an acceptance length counts the bonus token, so it is >= 1")
        if args.verify_block is not None and a > args.verify_block:
            raise UserError(f"--accept {a:g} exceeds --verify-block {args.verify_block}")
    if args.context < 0:
        raise UserError(f"--context must be >= 0, got {args.context}")
    if args.verify_block is not None and args.verify_block < 1:
        raise UserError(f"--verify-block must be >= 1, got {args.verify_block}")
    hw = _hardware(args)
    drafter = _drafter(args)
    hybrid = _is_hybrid(ckpt)
    if hybrid:
        plan, recipe_note = None, "none (input is already a hybrid)"
    else:
        report = build_report(ckpt, args.recipe)
        plan, recipe_note = report.plan, report.recipe_note
    reads = bw.profile_reads(ckpt, bytes_per_token(ckpt), plan, context=args.context,
                             kv_bytes=KV_DTYPES[args.kv_dtype], state_bytes=STATE_DTYPES[args.state_dtype])
    if args.calibrate is not None:
        if not args.calibrate > 0:
            raise UserError(f"--calibrate must be a positive tok/s, got {args.calibrate}")
        eff = bw.calibrate_efficiency(args.calibrate, reads.total("base"), hw.bandwidth_gbps)
        hw = bw.Hardware(hw.name, hw.label, hw.bandwidth_gbps, eff,
                         f"calibrated here: base decodes at {args.calibrate:g} tok/s (--calibrate)", True)

    base_tok_s = bw.decode_tok_s(reads.total("base"), hw.bandwidth_gbps, hw.efficiency)
    profiles = {}
    for p in bw.PROFILES:
        tok_s = bw.decode_tok_s(reads.total(p), hw.bandwidth_gbps, hw.efficiency)
        profiles[p] = {"label": bw.PROFILE_LABELS[p], "bytes_per_token": reads.total(p), "tok_s": tok_s,
                       "speedup": tok_s / base_tok_s}
    spec = []
    for a in accepts:
        base_spec = None
        for p in bw.PROFILES:
            tok_s, step = bw.speculative_tok_s(reads.parts[p], reads.experts, reads.top_k, a, hw.bandwidth_gbps,
                                               hw.efficiency, drafter, args.context, args.verify_block)
            base_spec = base_spec or tok_s
            positions = a if args.verify_block is None else args.verify_block
            spec.append({"profile": p, "accept": a, "tok_s": tok_s, "bytes_per_step": step,
                         "experts_per_layer": bw.expected_experts(reads.experts, reads.top_k, positions),
                         "speedup": tok_s / base_spec})
    data = {
        "schema_version": SCHEMA_VERSION,
        "source": ckpt.source_id or str(ckpt.root),
        "model_type": ckpt.model_type,
        "input_state": reads.input_state,
        "recipe": recipe_note,
        "hardware": {"name": hw.name, "label": hw.label, "bandwidth_gbps": hw.bandwidth_gbps,
                     "efficiency": hw.efficiency, "calibration": hw.calibration, "calibrated": hw.calibrated},
        "bandwidth_gbps": hw.bandwidth_gbps,
        "efficiency": hw.efficiency,
        "context": args.context,
        "kv_dtype_bytes": KV_DTYPES[args.kv_dtype],
        "state_dtype_bytes": STATE_DTYPES[args.state_dtype] or bw.state_dtype_bytes(ckpt.text_config),
        "experts": reads.experts,
        "top_k": reads.top_k,
        "drafter": {"name": drafter.name, "weight_bytes": drafter.weight_bytes,
                    "context_bytes": drafter.context_bytes(args.context), "shares_lm_head": drafter.shares_lm_head},
        "verify_positions": "accepted" if args.verify_block is None else args.verify_block,
        "bytes_per_token": reads.parts,
        "profiles": profiles,
        "speculative": spec,
        "notes": reads.notes,
    }
    if args.published:
        data["published_gb10"] = bw.published_comparison(reads, hw, drafter, args.context)
        if hw.name != "gb10" or hw.bandwidth_gbps != bw.HARDWARE["gb10"].bandwidth_gbps:
            data["notes"].append("--published compares with GB10 measurements, but the hardware here is not GB10")
    return data


def _gb(n: float) -> str:
    return f"{n / 1e9:7.3f}" if n >= 1e8 or n == 0 else f"{n / 1e9:7.5f}"


def render_text(data: dict) -> str:
    hw = data["hardware"]
    lines = [f"{data['source']}: {data['model_type']} ({data['input_state']}); recipe: {data['recipe']}",
             f"{hw['label']}: {hw['bandwidth_gbps']:g} GB/s x efficiency {hw['efficiency']:.3f} "
             f"= {hw['bandwidth_gbps'] * hw['efficiency']:.0f} GB/s effective ({hw['calibration']})",
             f"context {data['context']} tokens; single stream", "",
             "GB read per decoded token (no speculation)"]
    profiles = list(data["profiles"])
    lines.append(f"{'part':<20}" + "".join(f"{p:>11}" for p in profiles))
    parts = list(data["bytes_per_token"]["base"])
    for part in parts:
        lines.append(f"{part:<20}" + "".join(f"{_gb(data['bytes_per_token'][p][part]):>11}" for p in profiles))
    lines.append(f"{'total':<20}" + "".join(f"{_gb(data['profiles'][p]['bytes_per_token']):>11}" for p in profiles))
    lines.append(f"{'tok/s':<20}" + "".join(f"{data['profiles'][p]['tok_s']:>11.1f}" for p in profiles))
    lines.append(f"{'vs base':<20}" + "".join(f"{data['profiles'][p]['speedup'] - 1:>+11.1%}" for p in profiles))
    if data["speculative"]:
        d = data["drafter"]
        over = ("the accepted positions" if data["verify_positions"] == "accepted"
                else f"{data['verify_positions']} positions")
        lines += ["", f"speculative decoding: drafter {d['name']} ({d['weight_bytes'] / 1e9:.2f} GB"
                      f"{' + target lm-head' if d['shares_lm_head'] else ''}); experts = union over {over}",
                  f"{'accept':>8}{'experts/layer':>15}" + "".join(f"{p:>11}" for p in profiles) + f"{'dense gain':>12}"]
        by_accept: dict[float, dict] = {}
        for row in data["speculative"]:
            by_accept.setdefault(row["accept"], {})[row["profile"]] = row
        for a, rows in by_accept.items():
            first = next(iter(rows.values()))
            gain = rows["dense"]["tok_s"] / rows["base"]["tok_s"] - 1 if "dense" in rows and "base" in rows else 0.0
            lines.append(f"{a:>8g}{first['experts_per_layer']:>15.1f}"
                         + "".join(f"{rows[p]['tok_s']:>11.1f}" for p in profiles if p in rows) + f"{gain:>+12.1%}")
    if data.get("published_gb10"):
        lines += ["", "against published GB10 figures", f"{'profile':<11}{'accept':>7}{'published':>11}{'predicted':>11}{'gap':>8}  note"]
        for r in data["published_gb10"]:
            acc = "-" if r["accept"] is None else f"{r['accept']:g}"
            lines.append(f"{r['profile']:<11}{acc:>7}{r['tok_s']:>11.1f}{r['predicted']:>11.1f}{r['gap']:>+8.1%}  {r['note']}")
    for n in data["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def write_plot(data: dict, path: Path, reads_args: dict) -> None:
    """tok/s against acceptance length, one line per profile; dashed: the same profile without
    speculation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'hybrid-build[plot]'")
    top = max([12.0] + [r["accept"] for r in data["speculative"]])
    grid = [1 + i * 0.25 for i in range(int((top - 1) / 0.25) + 1)]
    if data["verify_positions"] != "accepted":
        grid = [a for a in grid if a <= data["verify_positions"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for i, p in enumerate(bw.PROFILES):
        color = f"C{i}"
        ys = [bw.speculative_tok_s(data["bytes_per_token"][p], accept=x, **reads_args)[0] for x in grid]
        ax.plot(grid, ys, color=color, label=f"{p}: {bw.PROFILE_LABELS[p]}")
        ax.axhline(data["profiles"][p]["tok_s"], color=color, linestyle="--", linewidth=0.8)
    for r in data["speculative"]:
        ax.plot([r["accept"]], [r["tok_s"]], "o", color=f"C{bw.PROFILES.index(r['profile'])}", markersize=3)
    hw = data["hardware"]
    ax.set_xlabel("acceptance length (tokens per verify step)")
    ax.set_ylabel("predicted decode tok/s (single stream)")
    ax.set_title(f"{Path(str(data['source'])).name} on {hw['label']}\n"
                 f"{hw['bandwidth_gbps']:g} GB/s x {hw['efficiency']:.3f}; dashed: no speculation", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _handle(args: argparse.Namespace) -> int:
    from .cli import emit_json

    if args.plot and not Path(args.plot).parent.exists():
        raise UserError(f"--plot {args.plot}: folder {Path(args.plot).parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="hybrid-build-plan-") as tmp:
        ckpt = open_checkpoint(args.source, args.revision, Path(tmp))
        data = build_plan(ckpt, args)
    if args.plot:
        write_plot(data, Path(args.plot), dict(
            experts=data["experts"], top_k=data["top_k"], bandwidth_gbps=data["bandwidth_gbps"],
            efficiency=data["efficiency"], drafter=_drafter(args), context=data["context"],
            verify_positions=args.verify_block))
        data["plot"] = str(args.plot)
    if args.json:
        emit_json(data)
    else:
        print(render_text(data))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def register(sub, common) -> None:
    from .cli import ExampleFormatter, add_json_flag

    p = sub.add_parser(
        "plan", parents=[common], formatter_class=ExampleFormatter,
        help="predict decode tok/s per profile from the checkpoint's headers (bandwidth model)",
        description="Count the bytes a decoded token reads, by part, for the source (base), FP8 shared experts, "
                    "int8 lm-head and both (dense), and predict single-stream tok/s as bandwidth x efficiency / "
                    "bytes, with and without speculative decoding. Headers only: nothing is downloaded but "
                    "headers, nothing is built. A hybrid artifact is read as the dense profile.",
        epilog="examples:\n"
               "  hybrid-build plan synthetic:qwen3.5-122b-a10b --hardware gb10 --published\n"
               "  hybrid-build plan ./Qwen3.5-122B-A10B-int4-AutoRound --accept 3 6.5 8.3 --plot plan.png\n"
               "  hybrid-build plan ./ckpt --bandwidth 1000 --calibrate 45 --json > plan.json")
    p.add_argument("source", metavar="SRC_OR_ARTIFACT",
                   help="checkpoint folder, Hub id, hybrid artifact, or synthetic:qwen3.5-122b-a10b")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument("--recipe", help="recipe name or YAML file (default: chosen from config.json)")
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", choices=sorted(bw.HARDWARE), default="gb10", help="preset (default: gb10)")
    g.add_argument("--bandwidth", type=float, metavar="GBPS", help="peak memory bandwidth in GB/s (overrides the preset)")
    g.add_argument("--efficiency", type=float, help="fraction of the bandwidth decode achieves (overrides the preset)")
    g.add_argument("--calibrate", type=float, metavar="TOK_S",
                   help="set the efficiency so that the base profile decodes at this measured tok/s")
    g = p.add_argument_group("workload")
    g.add_argument("--context", type=int, default=bw.DEFAULT_CONTEXT, help="context length in tokens (default: %(default)s)")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16", help="KV-cache dtype (default: bf16)")
    g.add_argument("--state-dtype", choices=list(STATE_DTYPES), default="auto",
                   help="DeltaNet state dtype (default: the config's mamba_ssm_dtype, else bf16)")
    g.add_argument("--accept", type=float, nargs="+", metavar="L",
                   help="acceptance lengths (tokens per verify step, bonus token included; "
                        f"default: {' '.join(f'{a:g}' for a in DEFAULT_ACCEPT)})")
    g.add_argument("--drafter", choices=["dflash", "none"], default="dflash",
                   help="drafter read per step: DFlash (1.6 GB + the target lm-head) or none (default: dflash)")
    g.add_argument("--drafter-gb", type=float, help="drafter weight bytes in GB (default: 1.6)")
    g.add_argument("--verify-block", type=int, metavar="N",
                   help="count experts over N verified positions (drafted + 1) instead of the accepted ones")
    g.add_argument("--published", action="store_true", help="compare with the published GB10 figures of the 122B")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of tok/s against acceptance length")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
