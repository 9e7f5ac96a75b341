"""The checkpoints of the `floor` step, as configs only: run HERE, carried in .gpufloor/.

    python scripts/gpu/floor_configs.py WORK OUT --tokenizer-from .gpusrc/src [--check]

The floor step times vLLM with ``load_format="dummy"``: vLLM builds the model from config.json,
fills every weight with random values on the GPU and never opens a safetensors file. So a
composition needs its config.json (and a tokenizer), not ~70 GB of shards; neither this disk nor
the GPU machine's (64 GiB) holds a 48-layer hybrid, which ``hybrid-build run`` would write densely
even from a sparse source. What is written here, per composition (real 122B widths, MTP left out,
vision depth 1, ``layer_types`` chosen):

- ``OUT/<name>-base/``: the source's config.json + quantization_config.json, taken from a sparse
  synthetic source written under WORK (headers over holes, ``write_synthetic_checkpoint``);
- ``OUT/<name>-dense/`` (``DENSE`` compositions): the hybrid's config.json and
  quantization_config.json, made by the assemble stage's own functions (``quantization_config``,
  ``hybrid_block``) on ``build.prepare`` of that source with the 122B recipe; no ``hybrid_build/``
  records (a config-only target is no build: ``serve`` takes it as a plain checkpoint);
- ``OUT/floor_plan.json``: layer counts and ``plan``'s bytes per token (base and dense, floor 0,
  the context of the timing) per composition, for the least-squares fit of the floor.

``--check`` also runs the real ``hybrid-build run --force --recipe qwen3.5-122b-a10b --no-validate``
on the 4-layer source (writes ~7 GB under WORK, deleted after) and records whether its config.json
equals the derived one, key for key.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

RECIPE = "qwen3.5-122b-a10b"
CONTEXT = 96  # a 32-token prompt plus, on average, half of the 128 decoded tokens


def types_of(n: int, full_every: int | None = 4, alternate: bool = False) -> list[str]:
    if alternate:
        return ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(n)]


# name -> layer types; the 3:1 mix is the model's own (a full-attention layer every 4th)
COMPOSITIONS: dict[str, list[str]] = {
    "L48": types_of(48),               # 36 linear + 12 full: the real model
    "L24": types_of(24),               # 18 + 6
    "L24h": types_of(24, alternate=True),  # 12 + 12
    "L24e": types_of(24, full_every=8),    # 21 + 3
    "L12": types_of(12),               # 9 + 3
    "L4": types_of(4),                 # 3 + 1: the warm-up engine (compiles every kernel once)
}
DENSE = ("L48", "L4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")


def source_config(types: list[str]) -> dict:
    from hybrid_build.pipeline.generators import synthetic as syn

    cfg = syn.qwen35_122b_config()
    tc = cfg["text_config"]
    tc["mtp_num_hidden_layers"] = 0  # MTP is not on the no-speculation decode path
    cfg["vision_config"]["depth"] = 1  # nor is the vision tower
    tc["layer_types"] = list(types) + ["linear_attention"] * (tc["num_hidden_layers"] - len(types))
    return syn.select_layers(cfg, range(len(types)))  # renumbers and rebuilds the per-layer extra_config


def write_source(work: Path, name: str, types: list[str]) -> Path:
    from hybrid_build.pipeline.generators import synthetic as syn

    src = work / f"{name}-src"
    if (src / "model.safetensors.index.json").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    cfg = source_config(types)
    tensors = [t for t in syn.synthetic_tensors(cfg) if not t.mtp]
    syn.write_synthetic_checkpoint(src, cfg, sparse=True, tensors=tensors)
    return src


def derived_hybrid_config(src: Path, out: Path) -> tuple[dict, dict]:
    """config.json and quantization_config.json as the assemble stage writes them."""
    from hybrid_build.pipeline.build import prepare
    from hybrid_build.pipeline.stages import assemble

    ctx = prepare(src, out, RECIPE, force=True)
    config = copy.deepcopy(ctx.source.config)
    qc = assemble.quantization_config(ctx)
    config["quantization_config"] = qc
    config["hybrid_build"] = assemble.hybrid_block(ctx)
    return config, qc


def write_dense(src: Path, dst: Path, work: Path, tokenizer_from: Path) -> dict:
    """The hybrid's config-only target: config.json, quantization_config.json and the tokenizer, and
    nothing of a build's own records (no ``hybrid_build/`` folder: a folder holding one but no
    provenance is a build that did not finish, which ``serve`` refuses). ``serve`` takes it as a
    plain checkpoint; the harness names the recipe (``--recipe``). Returns the config written."""
    config, qc = derived_hybrid_config(src, work)
    copy_config(src, dst, tokenizer_from)
    for name, data in (("config.json", config), ("quantization_config.json", qc)):
        tmp = dst / f"{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(dst / name)
    return config


def plan_bytes(folder: Path) -> dict:
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.serve.speed.speed_plan import PlanOptions, build_plan

    data = build_plan(Checkpoint.open(folder), PlanOptions(hardware="h200", floor_ms=0.0, context=CONTEXT,
                                                           recipe=RECIPE, accept=[1.0]))
    return {p: data["profiles"][p]["bytes_per_token"] for p in ("base", "fp8", "int8_head", "dense")} | {
        "parts_base": data["bytes_per_token"]["base"], "context": CONTEXT}


def copy_config(src: Path, dst: Path, tokenizer_from: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "quantization_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    for f in TOKENIZER_FILES:
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, dst / f)


def check_against_run(work: Path, src: Path, derived: dict) -> dict:
    out = work / "check-hybrid"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(["hybrid-build", "run", str(src), "-o", str(out), "--force", "--recipe", RECIPE,
                           "--no-validate", "-q"], capture_output=True, text=True)
    try:
        if proc.returncode:
            return {"ok": False, "error": (proc.stdout + proc.stderr)[-1500:]}
        real = json.loads((out / "config.json").read_text())
        strip = lambda c: {k: v for k, v in c.items() if k != "hybrid_build"}  # noqa: E731
        same_block = {k: v for k, v in real["hybrid_build"].items() if k != "source"} == \
            {k: v for k, v in derived["hybrid_build"].items() if k != "source"}
        return {"ok": strip(real) == strip(derived) and same_block,
                "config_equal_but_hybrid_block": strip(real) == strip(derived),
                "hybrid_block_equal_but_source_identity": same_block}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path, help="scratch folder for the sparse sources (outside the repo)")
    ap.add_argument("out", type=Path, help="the carried folder (.gpufloor)")
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    ap.add_argument("--check", action="store_true", help="compare the derived hybrid config with a real run's")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    plan: dict = {"context": CONTEXT, "recipe": RECIPE, "compositions": {}}
    for name, types in COMPOSITIONS.items():
        src = write_source(a.work, name, types)
        entry = {"layers": len(types), "linear": types.count("linear_attention"),
                 "full": types.count("full_attention"), "layer_types": types, "bytes": plan_bytes(src)}
        copy_config(src, a.out / f"{name}-base", a.tokenizer_from)
        if name in DENSE:
            config = write_dense(src, a.out / f"{name}-dense", a.work / f"{name}-hybrid-unwritten", a.tokenizer_from)
            if a.check and name == "L4":
                entry["derived_config_vs_hybrid_build_run"] = check_against_run(a.work, src, config)
        plan["compositions"][name] = entry
        print(name, entry["linear"], entry["full"], {k: v for k, v in entry["bytes"].items() if k in ("base", "dense")},
              entry.get("derived_config_vs_hybrid_build_run", ""), flush=True)
    (a.out / "floor_plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
