"""What ``hybrid-build plan`` predicts: single-stream decode speed per serve profile, from headers.

``build_plan(ckpt, PlanOptions)`` sizes the four profiles with the same recipe and conversion plan
``inspect`` and ``run`` use and applies the bandwidth model of ``bandwidth``; ``render_text`` and
``write_plot`` show it. The JSON schema and the model's assumptions are in docs/plan.md; the
command (``pipeline/commands/plan.py``) maps arguments to ``PlanOptions`` and prints.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import UserError
from hybrid_build.recipes.inventory import build_report, bytes_per_token

from . import bandwidth as bw
from . import multinode_plan as mnp

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: "recipe" is the name, "recipe_choice" the note; drafter.assumed
DEFAULT_ACCEPT = (2.0, 4.0, 6.0, 8.0, 10.0)
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1}
STATE_DTYPES = {"auto": None, "bf16": 2, "fp32": 4}


@dataclass
class PlanOptions:
    """The workload and hardware a prediction is for (see ``hybrid-build plan --help``)."""

    hardware: str = "gb10"
    bandwidth: float | None = None
    efficiency: float | None = None
    calibrate: float | None = None
    context: int = bw.DEFAULT_CONTEXT
    kv_dtype: str = "bf16"
    state_dtype: str = "auto"
    accept: list[float] | None = None
    drafter: str = "dflash"
    drafter_gb: float | None = None
    floor_ms: float | None = None
    verify_block: int | None = None
    published: bool = False
    recipe: str | None = None
    nodes: int | None = None  # predict for N nodes too (TP=N, PP=N): serve/multinode_plan.py
    link_gbps: float = mnp.LINK_GBPS
    link_latency_us: float = mnp.LINK_LATENCY_US


def _is_hybrid(ckpt: Checkpoint) -> bool:
    return bool(ckpt.hybrid_info) or any(
        (t.klass == "shared_expert" and t.storage == "fp8") or (t.klass == "lm_head" and t.storage == "int8")
        for t in ckpt.tensors.values())


def _hardware(args: PlanOptions) -> bw.Hardware:
    preset = bw.HARDWARE[args.hardware]
    if args.bandwidth is not None:
        if not args.bandwidth > 0:
            raise UserError(f"--bandwidth must be positive, got {args.bandwidth}")
        preset = bw.Hardware("custom", f"custom ({args.bandwidth:g} GB/s)", args.bandwidth, preset.efficiency,
                             f"{preset.name}'s efficiency ({preset.calibration})", False,
                             dataclasses.replace(preset.floor, source=f"{preset.name}'s floor ({preset.floor.source})",
                                                 measured=False))
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise UserError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        preset = bw.Hardware(preset.name, preset.label, preset.bandwidth_gbps, args.efficiency, "given (--efficiency)",
                             False, preset.floor)
    if args.floor_ms is not None:
        if args.floor_ms < 0:
            raise UserError(f"--floor-ms must be >= 0, got {args.floor_ms}")
        preset = bw.Hardware(preset.name, preset.label, preset.bandwidth_gbps, preset.efficiency, preset.calibration,
                             preset.calibrated, bw.StepFloor(args.floor_ms, (), "given (--floor-ms)", True))
    return preset


# the model whose DFlash drafter bw.DFLASH_122B measures (Qwen3.5-122B-A10B's widths and depth)
_DRAFTER_MODEL = {"hidden_size": 3072, "num_hidden_layers": 48}


def _drafter_assumed(ckpt: Checkpoint, args: PlanOptions) -> bool:
    """True when the drafter's size is the 122B's, taken for a model of other widths or depth."""
    return (args.drafter != "none" and args.drafter_gb is None
            and any(ckpt.text_config.get(k) != v for k, v in _DRAFTER_MODEL.items()))


def _drafter_notes(ckpt: Checkpoint, args: PlanOptions, drafter: bw.Drafter) -> list[str]:
    if not _drafter_assumed(ckpt, args):
        return []
    return [f"the speculative rows assume the 122B's DFlash drafter ({drafter.weight_bytes / 1e9:.1f} GB of weights); "
            "this model's drafter is not known here, and on a small model it dominates the step: pass "
            "--drafter-gb GB for its size, or --drafter none"]


def drafter_of(args: PlanOptions) -> bw.Drafter:
    if args.drafter == "none":
        return bw.NO_DRAFTER
    d = bw.DFLASH_122B
    if args.drafter_gb is not None:
        if args.drafter_gb < 0:
            raise UserError(f"--drafter-gb must be >= 0, got {args.drafter_gb}")
        d = bw.Drafter(d.name, int(args.drafter_gb * 1e9), d.kv_bytes_per_position, d.full_layers,
                       d.sliding_layers, d.window, d.shares_lm_head)
    return d


def build_plan(ckpt: Checkpoint, args: PlanOptions) -> dict:
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
    drafter = drafter_of(args)
    hybrid = _is_hybrid(ckpt)
    if hybrid:
        plan, recipe_name, recipe_note = None, None, "none (input is already a hybrid)"
    else:
        report = build_report(ckpt, args.recipe)
        plan, recipe_note = report.plan, report.recipe_note
        recipe_name = report.recipe.name if report.recipe else None
    reads = bw.profile_reads(ckpt, bytes_per_token(ckpt), plan, context=args.context,
                             kv_bytes=KV_DTYPES[args.kv_dtype], state_bytes=STATE_DTYPES[args.state_dtype])
    types = bw.layer_types(ckpt.text_config)
    floor_ms = hw.floor.ms(types)
    spec_floor = bw.spec_floor_ms(hw.floor, types, drafter)
    if args.calibrate is not None:
        if not args.calibrate > 0:
            raise UserError(f"--calibrate must be a positive tok/s, got {args.calibrate}")
        try:
            eff = bw.calibrate_efficiency(args.calibrate, reads.total("base"), hw.bandwidth_gbps, floor_ms)
        except ValueError as e:
            raise UserError(f"--calibrate: {e}; lower the floor with --floor-ms")
        hw = bw.Hardware(hw.name, hw.label, hw.bandwidth_gbps, eff,
                         f"calibrated here: base decodes at {args.calibrate:g} tok/s (--calibrate)", True, hw.floor)

    base_tok_s = bw.decode_tok_s(reads.total("base"), hw.bandwidth_gbps, hw.efficiency, floor_ms)
    profiles = {}
    for p in bw.PROFILES:
        tok_s = bw.decode_tok_s(reads.total(p), hw.bandwidth_gbps, hw.efficiency, floor_ms)
        profiles[p] = {"label": bw.PROFILE_LABELS[p], "bytes_per_token": reads.total(p), "tok_s": tok_s,
                       "speedup": tok_s / base_tok_s}
    spec = []
    for a in accepts:
        base_spec = None
        for p in bw.PROFILES:
            tok_s, step = bw.speculative_tok_s(reads.parts[p], reads.experts, reads.top_k, a, hw.bandwidth_gbps,
                                               hw.efficiency, drafter, args.context, args.verify_block, spec_floor)
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
        "recipe": recipe_name,
        "recipe_choice": recipe_note,
        "hardware": {"name": hw.name, "label": hw.label, "bandwidth_gbps": hw.bandwidth_gbps,
                     "efficiency": hw.efficiency, "calibration": hw.calibration, "calibrated": hw.calibrated,
                     "floor_source": hw.floor.source, "floor_measured": hw.floor.measured},
        "step_floor_ms": floor_ms,
        "spec_step_floor_ms": spec_floor,
        "bandwidth_gbps": hw.bandwidth_gbps,
        "efficiency": hw.efficiency,
        "context": args.context,
        "kv_dtype_bytes": KV_DTYPES[args.kv_dtype],
        "state_dtype_bytes": STATE_DTYPES[args.state_dtype] or bw.state_dtype_bytes(ckpt.text_config),
        "experts": reads.experts,
        "top_k": reads.top_k,
        "drafter": {"name": drafter.name, "weight_bytes": drafter.weight_bytes,
                    "context_bytes": drafter.context_bytes(args.context), "shares_lm_head": drafter.shares_lm_head,
                    "assumed": _drafter_assumed(ckpt, args)},
        "verify_positions": "accepted" if args.verify_block is None else args.verify_block,
        "bytes_per_token": reads.parts,
        "profiles": profiles,
        "speculative": spec,
        "notes": reads.notes + lever_notes(profiles, hw, floor_ms, reads.total("base")) + _drafter_notes(ckpt, args, drafter),
    }
    if args.nodes is not None:
        data["multinode"] = _multinode(ckpt, args, reads, hw, floor_ms, hybrid)
    if args.published:
        data["published_gb10"] = bw.published_comparison(reads, hw, drafter, args.context)
        if hw.name != "gb10" or hw.bandwidth_gbps != bw.HARDWARE["gb10"].bandwidth_gbps:
            data["notes"].append("--published compares with GB10 measurements, but the hardware here is not GB10")
    return data


def _multinode(ckpt: Checkpoint, args: PlanOptions, reads: bw.ProfileReads, hw: bw.Hardware, floor_ms: float,
               hybrid: bool) -> dict:
    if args.nodes < 2:
        raise UserError(f"--nodes must be 2 or more, got {args.nodes}")
    if not args.link_gbps > 0 or args.link_latency_us < 0:
        raise UserError("--link-gbps must be positive and --link-latency-us >= 0")
    source = mnp.LINK_SOURCE if args.link_latency_us == mnp.LINK_LATENCY_US else "given (--link-latency-us)"
    stored = sum(t.nbytes for t in ckpt.tensors.values() if t.klass != "mtp")  # vLLM skips MTP unless it drafts
    return mnp.predict(reads.parts, ckpt.text_config, hw, floor_ms, args.nodes,
                       mnp.Link(args.link_gbps, args.link_latency_us, source), stored,
                       "dense" if hybrid else "base")


LEVER_GAIN_FLOOR = 0.05  # under this, plan says in words that a lever will barely show


def lever_notes(profiles: dict, hw: bw.Hardware, floor_ms: float, base_bytes: float) -> list[str]:
    """Sentences for levers predicted to gain under 5% here, and for a floor that is not measured."""
    notes = []
    small = [p for p in ("fp8", "int8_head", "dense") if profiles[p]["speedup"] - 1 < LEVER_GAIN_FLOOR]
    if small:
        step_ms = 1e3 * bw.step_seconds(base_bytes, hw.bandwidth_gbps, hw.efficiency, floor_ms)
        gains = ", ".join(f"{p} {profiles[p]['speedup'] - 1:+.1%}" for p in small)
        notes.append(f"on {hw.label} these levers gain under {LEVER_GAIN_FLOOR:.0%} without speculation: {gains}. "
                     f"{floor_ms:.1f} ms of the {step_ms:.1f} ms base step is not bytes (the many small kernels of "
                     f"a step), so reading fewer bytes barely shows; the levers pay where memory is slow "
                     f"(DGX Spark: see --hardware gb10)")
    if not hw.floor.measured:
        notes.append(f"the per-step floor on {hw.label} is {hw.floor.source}: its predictions are not backed by a "
                     f"measurement on this hardware; pass --calibrate with a measured base tok/s, or --floor-ms")
    return notes


def lever_gain_note(ckpt: Checkpoint, hardware: str, profile: str = "dense") -> str | None:
    """One sentence for ``serve``: the lever the profile uses is predicted to gain under 5% on
    ``hardware`` (a preset name), or None."""
    data = build_plan(ckpt, PlanOptions(hardware=hardware, accept=[1.0]))
    key = "dense" if profile == "dense" else None
    if key is None or data["profiles"][key]["speedup"] - 1 >= LEVER_GAIN_FLOOR:
        return None
    gain = data["profiles"][key]["speedup"] - 1
    return (f"plan predicts the {profile} profile's levers gain {gain:+.1%} over base on "
            f"{data['hardware']['label']}: decode there is bound by the per-step floor "
            f"({data['step_floor_ms']:.1f} ms), not by bytes")


def _gb(n: float) -> str:
    return f"{n / 1e9:7.3f}" if n >= 1e8 or n == 0 else f"{n / 1e9:7.5f}"


def render_text(data: dict) -> str:
    hw = data["hardware"]
    lines = [f"{data['source']}: {data['model_type']} ({data['input_state']}); recipe: {data['recipe_choice']}",
             f"{hw['label']}: {hw['bandwidth_gbps']:g} GB/s x efficiency {hw['efficiency']:.3f} "
             f"= {hw['bandwidth_gbps'] * hw['efficiency']:.0f} GB/s effective ({hw['calibration']})",
             f"per-step floor {data['step_floor_ms']:.2f} ms ({hw['floor_source']})",
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
    if data.get("multinode"):
        lines.append(mnp.render_text(data["multinode"]))
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
