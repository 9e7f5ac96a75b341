"""``hybrid-build inspect``: what a checkpoint holds, what a decoded token reads, what a recipe changes.

Works from headers only. The JSON schema is documented in docs/inspect.md.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hybrid_build.core.byte_units import human_bytes
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import RecipeError
from hybrid_build.core.tensor_classes import CLASSES
from hybrid_build.recipes.schema import Recipe, load_recipe, select_recipe

from .conversion import ConversionPlan, plan_conversion

SCHEMA_VERSION = 1


def bytes_per_token(ckpt: Checkpoint) -> dict[str, int]:
    """Bytes read per decoded token (batch 1, no speculation) by class: every dense weight once,
    top-k of E routed experts, one embedding row; MTP and the vision tower are not read."""
    tc = ckpt.text_config
    top_k, experts = tc.get("num_experts_per_tok", 1), tc.get("num_experts", 1)
    vocab = tc.get("vocab_size") or 1
    out = {k: 0 for k in CLASSES}
    for t in ckpt.tensors.values():
        if t.klass in ("mtp", "vision"):
            continue
        if t.klass == "routed_expert":
            out[t.klass] += t.nbytes * top_k / experts
        elif t.klass == "embedding":
            out[t.klass] += t.nbytes / vocab
        else:
            out[t.klass] += t.nbytes
    return {k: int(round(v)) for k, v in out.items()}


@dataclass
class InspectReport:
    ckpt: Checkpoint
    recipe: Recipe | None
    recipe_note: str
    plan: ConversionPlan | None

    def classes(self) -> dict[str, dict]:
        out = {k: {"count": 0, "bytes": 0, "storage": Counter()} for k in CLASSES}
        for t in self.ckpt.tensors.values():
            c = out[t.klass]
            c["count"] += 1
            c["bytes"] += t.nbytes
            c["storage"][t.storage] += 1
        return {k: {"count": v["count"], "bytes": v["bytes"], "storage": dict(v["storage"])} for k, v in out.items()}

    def to_json(self) -> dict:
        c = self.ckpt
        bpt = bytes_per_token(c)
        saved_per_token = 0
        if self.plan:
            recipe = self.plan.recipe
            head_at_load = not recipe.output.fmt.stores_head(recipe.lm_head.storage)
            saved_per_token = sum(x.in_bytes - x.out_bytes for x in self.plan.conversions
                                  if not (x.kind == "int8" and head_at_load))
        return {
            "schema_version": SCHEMA_VERSION,
            "source": c.source_id or str(c.root),
            "model_type": c.model_type,
            "vl_form": c.is_vl,
            "quantization": {"method": c.quant.method, "bits": c.quant.bits, "group_size": c.quant.group_size,
                             "sym": c.quant.sym, "packing_format": c.quant.packing_format,
                             "extra_config_entries": len(c.quant.extra_config)},
            "files": [{"name": f, "in_index": c.index is None or f in set(c.index["weight_map"].values())}
                      for f in c.files],
            "total_bytes": sum(t.nbytes for t in c.tensors.values()),
            "classes": self.classes(),
            "bytes_per_token": bpt,
            "bytes_per_token_total": sum(bpt.values()),
            "conversion": None if self.plan is None else dict(
                self.plan.to_json(), recipe_choice=self.recipe_note,
                bytes_per_token_after=sum(bpt.values()) - saved_per_token),
            "problems": [{"severity": p.severity, "code": p.code, "message": p.message} for p in c.problems],
            "tensors": [t.to_json() for t in c.tensors.values()],
        }


def build_report(ckpt: Checkpoint, recipe_arg: str | None = None) -> InspectReport:
    recipe, note = None, ""
    try:
        if recipe_arg:
            recipe, note = load_recipe(recipe_arg), f"recipe {recipe_arg} (given)"
        else:
            recipe = select_recipe(ckpt.text_config, ckpt.model_type)
            note = f"recipe {recipe.name} (chosen from config.json)"
    except RecipeError as e:
        if recipe_arg:
            raise
        recipe, note = Recipe(name="default"), f"default conversion ({e})"
    plan = None
    if not ckpt.errors() and not ckpt.hybrid_info:
        plan = plan_conversion(ckpt, recipe)
    return InspectReport(ckpt, recipe, note, plan)


def render_text(data: dict) -> str:
    lines = [f"{data['source']}: {data['model_type']} ({'VL' if data['vl_form'] else 'text-only'} form), "
             f"quantization {data['quantization']['method'] or 'none'}"
             + (f" {data['quantization']['bits']}-bit g{data['quantization']['group_size']}"
                if data['quantization']['bits'] else "")]
    lines.append(f"{len(data['tensors'])} tensors in {len(data['files'])} files, {human_bytes(data['total_bytes'])}")
    lines.append("")
    lines.append(f"{'class':<20}{'tensors':>8}{'bytes':>12}{'per token':>12}  storage")
    for name, c in data["classes"].items():
        if not c["count"]:
            continue
        storage = ", ".join(f"{k} x{v}" for k, v in sorted(c["storage"].items()))
        lines.append(f"{name:<20}{c['count']:>8}{human_bytes(c['bytes']):>12}"
                     f"{human_bytes(data['bytes_per_token'][name]):>12}  {storage}")
    lines.append(f"{'read per decoded token':<40}{human_bytes(data['bytes_per_token_total']):>12}")
    conv = data["conversion"]
    if conv:
        lines.append("")
        lines.append(f"conversion: {conv['recipe_choice']}, output format {conv['format']}")
        for kind, label in (("fp8", "FP8 block-128"), ("int8", "int8 per-row")):
            items = [c for c in conv["conversions"] if c["kind"] == kind]
            if items:
                before = sum(c["bytes_before"] for c in items)
                after = sum(c["bytes_after"] for c in items)
                lines.append(f"  {len(items)} tensor(s) -> {label}: {human_bytes(before)} -> {human_bytes(after)}")
        lines.append(f"  per decoded token: {human_bytes(data['bytes_per_token_total'])} -> "
                     f"{human_bytes(conv['bytes_per_token_after'])}")
    if data["problems"]:
        lines.append("")
        for p in data["problems"]:
            lines.append(f"{p['severity']}: {p['message']}")
    return "\n".join(lines)
