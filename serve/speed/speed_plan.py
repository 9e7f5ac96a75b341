"""What ``hybrid-build plan`` predicts: decode speed per serve profile, from headers: one stream, or
several sharing each verify step (``--concurrency``), at one or more context lengths.

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
from typing import TYPE_CHECKING

from hybrid_build.core.errors import UserError
from hybrid_build.core.limits import MAX_ACCEPT

from . import bandwidth as bw
from . import multinode_plan as mnp

if TYPE_CHECKING:  # `plan --help` reads this module's choices: the checkpoint reader and the memory planner wait
    from hybrid_build.core.checkpoint import Checkpoint

    from . import memory_plan as mem

log = logging.getLogger(__name__)

# 2: "recipe" is the name, "recipe_choice" the note; drafter.assumed. 3: "concurrency" rows, "contexts",
# "context_layout", "stream_overlap", "published_gb10_concurrency"; drafter.context_bytes is per stream
# at the KV dtype; published rows include the hardware's floor. Every schema-2 field keeps its meaning.
SCHEMA_VERSION = 3
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
    nodes: int | None = None  # predict for N nodes too (TP=N, PP=N): serve/speed/multinode_plan.py
    contexts: list[int] | None = None  # "concurrency" rows for each; the per-token tables use ``context``
    concurrency: list[int] | None = None  # streams sharing each verify step: a row set per count
    profile: list[str] | None = None  # the profiles whose speculative and concurrency rows are shown
    stream_overlap: float = 0.0  # share of steps in which the streams emit the same tokens (bandwidth.batch_experts)
    link_gbps: float = mnp.LINK_GBPS
    link_latency_us: float = mnp.LINK_LATENCY_US
    engine: str = "0.26.0"  # the vLLM version whose KV-cache planning the memory figures follow


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
        d = dataclasses.replace(d, weight_bytes=int(args.drafter_gb * 1e9))
    return d


def _check_workload(ckpt: Checkpoint, args: PlanOptions) -> tuple[list[int], list[int] | None]:
    """The contexts and stream counts asked for, refused with one line where the model cannot take them."""
    contexts = list(dict.fromkeys(args.contexts or [args.context]))
    longest, source = bw.max_context(ckpt.text_config)
    for c in [args.context] + contexts:
        if c < 0:
            raise UserError(f"--context must be >= 0, got {c}")
        if c > longest:
            raise UserError(f"--context {c} exceeds {longest:,} tokens, {source}")
    streams = None
    if args.concurrency is not None:
        streams = list(dict.fromkeys(args.concurrency))
        bad = [n for n in streams if n < 1]
        if bad or not streams:
            raise UserError(f"--concurrency counts streams, so it is >= 1, got {bad[0] if bad else 'nothing'}")
    if not 0 <= args.stream_overlap <= 1:
        raise UserError(f"--stream-overlap is a share of steps, in [0, 1], got {args.stream_overlap:g}")
    for p in args.profile or []:
        if p not in bw.PROFILES:
            raise UserError(f"unknown profile {p!r}: choose from {', '.join(bw.PROFILES)}")
    return contexts, streams


def check_speculation(args: PlanOptions) -> tuple[bw.Drafter, list[float]]:
    """The drafter and the acceptance lengths, refused in one line where a step cannot emit them: an
    acceptance length counts the bonus token, so it lies between 1 and the speculative tokens + 1
    (``--verify-block``, else the drafter's block). Needs no checkpoint: ``plan`` checks it first."""
    drafter = drafter_of(args)
    accepts = list(args.accept) if args.accept else list(DEFAULT_ACCEPT)
    if args.verify_block is not None and not 1 <= args.verify_block <= MAX_ACCEPT:
        raise UserError(f"--verify-block counts the drafted tokens + 1: between 1 and {MAX_ACCEPT}, "
                        f"got {args.verify_block}")
    for a in accepts:
        if not 1 <= a <= MAX_ACCEPT:  # also what 1e308 or nan would be: the arithmetic below divides by it
            raise UserError(f"--accept {a:g}: an acceptance length counts the bonus token, so it is between 1 and "
                            f"{MAX_ACCEPT} (the most speculative tokens a profile takes + 1)")
        if args.verify_block is not None and a > args.verify_block:
            raise UserError(f"--accept {a:g} exceeds --verify-block {args.verify_block}")
        if args.verify_block is None and drafter.block and a > drafter.block:
            raise UserError(f"--accept {a:g}: the {drafter.name} drafter emits at most {drafter.block} tokens a step "
                            f"({drafter.block - 1} drafted + the bonus token)")
    return drafter, accepts


def build_plan(ckpt: Checkpoint, args: PlanOptions) -> dict:
    """Everything ``plan`` prints, as the JSON document of docs/plan.md."""
    # here, not at the top: the recipes import the output formats (torch); `plan --help` reads this module
    from hybrid_build.recipes.inventory import build_report, bytes_per_token

    drafter, accepts = check_speculation(args)
    contexts, streams = _check_workload(ckpt, args)
    hw = _hardware(args)
    hybrid = _is_hybrid(ckpt)
    if hybrid:
        plan, recipe_name, recipe_note = None, None, "none (input is already a hybrid)"
    else:
        report = build_report(ckpt, args.recipe)
        plan, recipe_note = report.plan, report.recipe_note
        recipe_name = report.recipe.name if report.recipe else None
    per_token = bytes_per_token(ckpt)
    kv_bytes, state_bytes = KV_DTYPES[args.kv_dtype], STATE_DTYPES[args.state_dtype]
    reads = bw.profile_reads(ckpt, per_token, plan, context=args.context, kv_bytes=kv_bytes, state_bytes=state_bytes)
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
    shown = list(dict.fromkeys(args.profile)) if args.profile else list(bw.PROFILES)
    spec = []
    for a in accepts:
        base_spec = None
        for p in bw.PROFILES:
            tok_s, step = bw.speculative_tok_s(reads.parts[p], reads.experts, reads.top_k, a, hw.bandwidth_gbps,
                                               hw.efficiency, drafter, args.context, args.verify_block, spec_floor,
                                               kv_bytes=kv_bytes)
            base_spec = base_spec or tok_s
            positions = a if args.verify_block is None else args.verify_block
            if p in shown:
                spec.append({"profile": p, "accept": a, "tok_s": tok_s, "bytes_per_step": step,
                             "experts_per_layer": bw.expected_experts(reads.experts, reads.top_k, positions),
                             "speedup": tok_s / base_spec})
    rows = []
    if streams is not None or len(contexts) > 1:
        rows = _concurrency_rows(ckpt, args, per_token, plan, hw, drafter, accepts, contexts, streams or [1],
                                 spec_floor, shown)
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
        "contexts": contexts,
        "context_layout": dict(bw.context_layout(ckpt.text_config, kv_bytes, state_bytes),
                               **dict(zip(("max_context", "max_context_source"), bw.max_context(ckpt.text_config)))),
        "kv_dtype_bytes": KV_DTYPES[args.kv_dtype],
        "state_dtype_bytes": STATE_DTYPES[args.state_dtype] or bw.state_dtype_bytes(ckpt.text_config),
        "experts": reads.experts,
        "top_k": reads.top_k,
        "drafter": {"name": drafter.name, "weight_bytes": drafter.weight_bytes,
                    "context_bytes": drafter.context_bytes(args.context, kv_bytes),
                    "shares_lm_head": drafter.shares_lm_head,
                    "assumed": _drafter_assumed(ckpt, args)},
        "verify_positions": "accepted" if args.verify_block is None else args.verify_block,
        "bytes_per_token": reads.parts,
        "profiles": profiles,
        "speculative": spec,
        "stream_overlap": args.stream_overlap,
        "concurrency": rows,
        "notes": (reads.notes + lever_notes(profiles, hw, floor_ms, reads.total("base"))
                  + _drafter_notes(ckpt, args, drafter)),
    }
    if rows:
        data["concurrency_basis"] = concurrency_basis(ckpt, args, hw, spec_floor, drafter)
    data["memory"] = memory_section(ckpt, args, hw, plan, contexts, streams or [1], drafter)
    data["notes"] += data["memory"].get("advice", [])
    if args.nodes is not None:
        data["multinode"] = _multinode(ckpt, args, reads, hw, floor_ms, hybrid)
    if args.published:
        data["published_gb10"] = bw.published_comparison(reads, hw, drafter, args.context, floor_ms, spec_floor)
        seed_reads = bw.profile_reads(ckpt, per_token, plan, context=bw.SEED_CONTEXT, state_bytes=state_bytes)
        data["published_gb10_concurrency"] = bw.published_concurrency(seed_reads, hw, drafter, bw.SEED_CONTEXT,
                                                                      spec_floor)
        if hw.name != "gb10" or hw.bandwidth_gbps != bw.HARDWARE["gb10"].bandwidth_gbps:
            data["notes"].append("--published compares with GB10 measurements, but the hardware here is not GB10")
    return data


def _concurrency_rows(ckpt: Checkpoint, args: PlanOptions, per_token: dict, plan, hw: bw.Hardware,
                      drafter: bw.Drafter, accepts: list[float], contexts: list[int], streams: list[int],
                      spec_floor: float, shown: list[str]) -> list[dict]:
    """One row per context, acceptance, stream count and profile: ``streams`` streams, each at
    acceptance ``accept`` and ``context`` tokens, share every verify step (bandwidth.step_reads)."""
    kv_bytes, state_bytes = KV_DTYPES[args.kv_dtype], STATE_DTYPES[args.state_dtype]
    rows = []
    for c in contexts:
        reads = bw.profile_reads(ckpt, per_token, plan, context=c, kv_bytes=kv_bytes, state_bytes=state_bytes)
        for a in accepts:
            positions = a if args.verify_block is None else args.verify_block
            for n in streams:
                base = None
                for p in bw.PROFILES:
                    parts = reads.parts[p]
                    tok_s, step = bw.speculative_tok_s(parts, reads.experts, reads.top_k, a, hw.bandwidth_gbps,
                                                       hw.efficiency, drafter, c, args.verify_block, spec_floor, n,
                                                       args.stream_overlap, kv_bytes)
                    base = base or tok_s
                    if p not in shown:
                        continue
                    rows.append({
                        "profile": p, "accept": a, "concurrency": n, "context": c,
                        "positions_per_stream": positions,
                        "experts_per_layer": bw.batch_experts(reads.experts, reads.top_k, positions, n,
                                                              args.stream_overlap),
                        "kv_bytes_per_stream": parts["kv_cache"],
                        "state_bytes_per_stream": parts["linear_state"],
                        "drafter_kv_bytes_per_stream": drafter.context_bytes(c, kv_bytes),
                        "bytes_per_step": step,
                        "floor_ms": spec_floor,
                        "step_ms": 1e3 * a / tok_s,
                        "tok_s_per_stream": tok_s,
                        "tok_s_total": n * tok_s,
                        "speedup": tok_s / base,
                    })
    return rows


def concurrency_basis(ckpt: Checkpoint, args: PlanOptions, hw: bw.Hardware, spec_floor: float,
                      drafter: bw.Drafter) -> list[str]:
    """What the concurrency rows rest on, one sentence each."""
    tc = ckpt.text_config
    lay = bw.context_layout(tc, KV_DTYPES[args.kv_dtype], STATE_DTYPES[args.state_dtype])
    over = ("accepted positions" if args.verify_block is None else f"{args.verify_block} verified positions")
    out = [
        f"bandwidth: {hw.label}, efficiency {hw.efficiency:.3f}: {hw.calibration}"
        + ("" if hw.calibrated else " (not backed by a measurement on this hardware)"),
        (f"floor: {spec_floor:.2f} ms per step, paid once whatever the streams ({hw.floor.source}"
         + ("" if hw.floor.measured else "; not measured on this hardware") + "; fitted on one stream only)")
        if spec_floor else f"floor: {hw.floor.source}",
        "one verify step serves every stream: attention, DeltaNet, shared-expert, router and lm-head weights"
        + (" and the drafter's weights (and the lm-head it shares)" if drafter.weight_bytes else "")
        + " are read once per step; each stream's KV cache"
        + (", DeltaNet state and drafter KV" if drafter.weight_bytes else " and DeltaNet state")
        + " are read per stream",
        f"routed experts: the expected union over every stream's {over}, each token picking "
        f"{int(tc.get('num_experts_per_tok') or 1)} of {int(tc.get('num_experts') or 1)} uniformly and "
        "independently (an assumption: real routing is skewed and correlated, which reads fewer experts)"
        + ("" if not args.stream_overlap else
           f"; the streams emit the same tokens in {args.stream_overlap:.0%} of steps (--stream-overlap)"),
        f"every stream at the same acceptance and context; KV per token {lay['kv_bytes_per_token']:,} B "
        f"({lay['full_attention_layers']} full-attention layers x 2 x {lay['kv_heads']} KV heads x "
        f"{lay['head_dim']} x {lay['kv_dtype_bytes']} B, from config.json); DeltaNet state "
        f"{lay['state_size_per_stream']:,} B per stream ({lay['linear_attention_layers']} layers, whatever the "
        "context), read and written back each step",
        "per-stream tok/s = acceptance / step time; total = streams x per-stream",
    ]
    return out


def memory_inputs(ckpt: Checkpoint, args: PlanOptions, hw: bw.Hardware, plan, drafter: bw.Drafter,
                  profile: str = "dense") -> mem.MemoryInputs | None:
    """The memory plan's inputs for a serve profile of the recipe on this hardware (None: no profile)."""
    from hybrid_build.recipes.schema import load_recipe

    from . import memory_plan as mem

    recipe = plan.recipe if plan is not None else None
    if recipe is None and args.recipe:
        recipe = load_recipe(args.recipe)
    prof = recipe.serve.profiles.get(profile) if recipe is not None and recipe.serve else None
    if prof is None:
        return None
    if drafter.weight_bytes == 0 and prof.speculative is not None:
        prof = prof.model_copy(update={"speculative": None})
    if args.kv_dtype == "fp8":
        prof = prof.model_copy(update={"kv_cache_dtype": "fp8"})
    weights = sum(t.nbytes for t in ckpt.tensors.values() if t.klass != "mtp")
    if plan is not None and prof.artifact == "hybrid":
        fp8, head = bw._savings_from_source(plan)
        weights -= fp8 + head
    reserve, basis = mem.reserve_for(hw.name)
    return mem.profile_inputs(
        ckpt.text_config, prof, args.engine, mem.DFLASH_DRAFTER, total_bytes=int(mnp.MEMORY_GB.get(hw.name, 128) * 1e9),
        weights_bytes=weights, drafter_bytes=drafter.weight_bytes if prof.speculative else 0, reserve_bytes=reserve,
        reserve_basis=basis)


def memory_section(ckpt: Checkpoint, args: PlanOptions, hw: bw.Hardware, plan, contexts: list[int],
                   streams: list[int], drafter: bw.Drafter) -> dict:
    """The KV pool of the recipe's dense profile as vLLM ``args.engine`` plans it, the largest context one
    stream holds, and how many streams of each context fit (serve/speed/memory_plan.py)."""
    from . import memory_plan as mem

    if not bw.layer_types(ckpt.text_config).count("linear_attention"):
        return {}
    try:
        inputs = memory_inputs(ckpt, args, hw, plan, drafter)
        if inputs is None:
            return {}
        mp = mem.plan_memory(inputs)
    except mem.MemoryPlanError as e:
        return {"error": str(e), "advice": [f"memory: {e}"]}
    out = mp.to_json()
    out["profile"] = "dense"
    out["fit"] = [{"context": c, "streams": n, "whole": f.whole, "next_tokens": f.next_tokens,
                   "blocks_per_stream": f.blocks_per_stream}
                  for c in contexts for n in streams for f in [mp.streams_that_fit(c)]]
    out["advice"] = [a for c in contexts for n in streams if (a := mem.fit_advice(mp, c, n))]
    return out


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
        shown = list(dict.fromkeys(r["profile"] for r in data["speculative"]))
        gain = "base" in shown and "dense" in shown
        lines += ["", f"speculative decoding: drafter {d['name']} ({d['weight_bytes'] / 1e9:.2f} GB"
                      f"{' + target lm-head' if d['shares_lm_head'] else ''}); experts = union over {over}",
                  f"{'accept':>8}{'experts/layer':>15}" + "".join(f"{p:>11}" for p in shown)
                  + (f"{'dense gain':>12}" if gain else "")]
        by_accept: dict[float, dict] = {}
        for row in data["speculative"]:
            by_accept.setdefault(row["accept"], {})[row["profile"]] = row
        for a, rows in by_accept.items():
            first = next(iter(rows.values()))
            lines.append(f"{a:>8g}{first['experts_per_layer']:>15.1f}"
                         + "".join(f"{rows[p]['tok_s']:>11.1f}" for p in shown)
                         + (f"{rows['dense']['tok_s'] / rows['base']['tok_s'] - 1:>+12.1%}" if gain else ""))
    if data.get("memory", {}).get("pool_tokens"):
        lines += _render_memory(data["memory"])
    if data.get("concurrency"):
        lines += _render_concurrency(data)
    if data.get("published_gb10"):
        lines += ["", "against published GB10 figures",
                  f"{'profile':<11}{'accept':>7}{'published':>11}{'predicted':>11}{'gap':>8}  note"]
        for r in data["published_gb10"]:
            acc = "-" if r["accept"] is None else f"{r['accept']:g}"
            lines.append(f"{r['profile']:<11}{acc:>7}{r['tok_s']:>11.1f}{r['predicted']:>11.1f}{r['gap']:>+8.1%}  "
                         f"{r['note']}")
    if data.get("published_gb10_concurrency"):
        lines += ["", f"against the seed's concurrency table (GB10, dense, DFlash n=12, one prompt in every stream, "
                      f"context <= {bw.SEED_CONTEXT}); streams in step {bw.SEED_STREAM_OVERLAP:.1%} of steps "
                      "(calibrated on code at 2 streams) / independent",
                  f"{'workload':<9}{'accept':>7}{'streams':>8}{'published':>10}{'predicted':>10}{'gap':>8}"
                  f"{'independent':>12}{'gap':>8}   experts/layer: model, independent, implied"]
        for r in data["published_gb10_concurrency"]:
            lines.append(f"{r['workload']:<9}{r['accept']:>7g}{r['concurrency']:>8}{r['tok_s']:>10.1f}"
                         f"{r['predicted']:>10.1f}{r['gap']:>+8.1%}{r['predicted_independent']:>12.1f}"
                         f"{r['gap_independent']:>+8.1%}   {r['experts_per_layer']:.1f}, "
                         f"{r['experts_independent']:.1f}, {r['experts_implied']:.1f}"
                         + ("   (calibration)" if r["calibrates"] else ""))
    for n in data["notes"]:
        lines.append(f"note: {n}")
    if data.get("multinode"):
        lines.append(mnp.render_text(data["multinode"]))
    return "\n".join(lines)


def _render_memory(m: dict) -> list[str]:
    kv = {"auto": "bf16"}.get(m["kv_cache_dtype"], m["kv_cache_dtype"])
    lines = ["", f"memory ({m['profile']} profile as vLLM {m['engine']} plans it; {m['layout']} prefix-cache layout, "
                 f"{kv} KV, {m['num_speculative_tokens']} speculative tokens, gpu_memory_utilization "
                 f"{m['gpu_memory_utilization']:g})",
             f"  weights {m['weights_bytes'] / 1e9:.1f} GB + drafter {m['drafter_bytes'] / 1e9:.1f} GB + reserve "
             f"{m['reserve_bytes'] / 1e9:.1f} GB ({m['reserve_basis']}) -> KV pool {m['kv_pool_bytes'] / 1e9:.1f} GB = "
             f"{m['num_blocks']:,} blocks of {m['block_bytes']:,} B",
             f"  KV per token {m['kv_bytes_per_token'] / 1024:g} KiB (padding included); per stream, whatever its "
             f"length: {m['state_bytes_per_stream'] / 1e9:.2f} GB of GDN state with its speculative pages",
             f"  pool {m['pool_tokens']:,} tokens (the figure vLLM logs); largest context one stream holds "
             f"{m['max_context_tokens']:,}"]
    if m.get("hit_unit"):
        lines.append(f"  warm prefix hits land on a {m['hit_unit']:,}-token grid" + (
            f" (--block-size {m['prefix_match_unit']} --prefix-match-unit {m['prefix_match_unit']} on vLLM's own "
            "pages: a resent prompt hits to within that of its end)" if m.get("prefix_match_unit") else
            " (the GDN block: pages padded)" if m["layout"] == "prefix_align" else ""))
    for f in m["fit"]:
        ok = "fit" if f["whole"] >= f["streams"] else "DO NOT FIT"
        lines.append(f"  {f['streams']} x {f['context']:,} tokens: {ok} ({f['whole']} whole streams"
                     + (f", the next gets {f['next_tokens']:,} tokens" if f["next_tokens"] else "") + ")")
    return lines


def _render_concurrency(data: dict) -> list[str]:
    rows = data["concurrency"]
    shown = list(dict.fromkeys(r["profile"] for r in rows))
    lay = data["context_layout"]
    kv = {1: "fp8", 2: "bf16", 4: "fp32"}.get(lay["kv_dtype_bytes"], f"{lay['kv_dtype_bytes']} B")
    lines = ["", f"context reads per stream: KV cache {lay['full_attention_layers']} full-attention layers x 2 x "
                 f"{lay['kv_heads']} KV heads x {lay['head_dim']} x {kv} = {lay['kv_bytes_per_token'] / 1024:g} KiB "
                 f"per token; DeltaNet state {lay['state_size_per_stream'] / 1e6:.1f} MB per stream "
                 f"({lay['linear_attention_layers']} layers, any context; max context {lay['max_context']:,})",
             "GB read per step per stream (the state is read and written back)",
             f"{'context':>9}{'KV cache':>10}{'DeltaNet state':>16}{'drafter KV':>12}"]
    seen = set()
    for r in rows:
        if r["context"] in seen:
            continue
        seen.add(r["context"])
        lines.append(f"{r['context']:>9}{r['kv_bytes_per_stream'] / 1e9:>10.3f}"
                     f"{r['state_bytes_per_stream'] / 1e9:>16.3f}{r['drafter_kv_bytes_per_stream'] / 1e9:>12.3f}")
    lines += ["", "concurrent streams sharing each verify step: tok/s per stream / total"
                  + (f" (streams in step {data['stream_overlap']:.0%} of steps)" if data["stream_overlap"] else ""),
              ]
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["context"], r["accept"], r["concurrency"]), {})[r["profile"]] = r
    header = ["context", "accept", "streams", "experts/layer"] + [h for p in shown for h in (f"{p} /stream", "total")]
    cells = [[str(c), f"{a:g}", str(n), f"{next(iter(by.values()))['experts_per_layer']:.1f}"]
             + [f"{by[p][k]:.1f}" for p in shown for k in ("tok_s_per_stream", "tok_s_total")]
             for (c, a, n), by in groups.items()]
    lines += aligned(header, cells)
    lines += [f"rests on: {b}" for b in data.get("concurrency_basis", [])]
    return lines


def aligned(header: list[str], rows: list[list[str]], gap: int = 2) -> list[str]:
    """A table as text: each column right-aligned to its widest cell or heading, ``gap`` spaces
    apart, so that no heading runs into the next whatever the profile names' lengths."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return [(" " * gap).join(f"{str(x):>{w}}" for x, w in zip(line, widths)) for line in [header, *rows]]


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
