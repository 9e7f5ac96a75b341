"""The ``assemble`` stage: write the output checkpoint from the source and the stage results.

Every output tensor is planned first (names, dtypes, shapes, shard offsets; nothing is read but
headers). Unchanged tensors are byte ranges of the source; converted ones are byte ranges of the
intermediate files of ``calibrate`` and ``quantize-head`` (the latter may still be running in the
background: its layout is known, and the head's tensors go last in their shard); the output format
(``core/formats``) names and arranges them, and a format that repacks the INT4 tensors transposes
data one tensor at a time. Two shards are written at a time, each hashed while written, under
temporary names renamed when complete; a try cut short resumes its complete shards. Then the
source's other files, ``config.json`` (the format's ``quantization_config`` and the
``hybrid_build`` block) and, last, the index. The index and any earlier provenance are removed
before the first shard, so a folder with an index holds complete shards; ``record`` writes the
provenance from the hashes this stage returns.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybrid_build.core import __version__
from hybrid_build.core.artifact import CONFIG, PROVENANCE, QUANT_CONFIG, RECIPE, build_outputs
from hybrid_build.core.errors import ArtifactError
from hybrid_build.core.formats.base import copied
from hybrid_build.core.manifest import sha256_file
from hybrid_build.core.safetensors_io import (
    INDEX_NAME,
    TMP_SUFFIX,
    ByteRange,
    OutTensor,
    ShardHasher,
    ShardPlan,
    copy_file_atomic,
    plan_shards,
    write_shard,
    write_text_atomic,
)
from hybrid_build.core.tensor_classes import split_module

from ..context import BuildContext, output_bytes
from .base import Stage, StageIO, StageOutput

log = logging.getLogger(__name__)

SKIP_COPY = {CONFIG, QUANT_CONFIG, INDEX_NAME}


def _from_intermediate(entries: dict, name: str) -> OutTensor:
    if name not in entries:
        raise ArtifactError(f"intermediate result lacks {name}: run the earlier stages again (--from calibrate)")
    th, rng = entries[name]
    return OutTensor(name, th.dtype, th.shape, rng)


def plan_output(ctx: BuildContext, up: dict[str, StageOutput]) -> list[ShardPlan]:
    """Every output file with its tensors, in source order; nothing is read but headers. The
    converted tensors come from ``up``: calibrate's file, and quantize-head's (finished, or still
    running in the background with its layout known)."""
    fmt = ctx.recipe.output.fmt
    conv = {c.module: c for c in ctx.plan.conversions}
    fp8 = up["calibrate"].entries()
    head = up["quantize-head"].entries()
    src = ctx.source
    indexed_files = set((src.index or {}).get("weight_map", {}).values()) if src.index else set(src.files)
    main: list[OutTensor] = []
    extra: dict[str, list[OutTensor]] = {}
    order = sorted(src.tensors.values(), key=lambda t: (t.file not in indexed_files, t.file, t.start))
    for t in order:
        dest = main if t.file in indexed_files else extra.setdefault(t.file, [])
        module, part = split_module(t.name)
        c = conv.get(module)
        if c is not None and part == "weight":
            if c.kind == "fp8":
                dest.append(_from_intermediate(fp8, module + ".weight"))
                scale = _from_intermediate(fp8, module + ".weight_scale_inv")  # calibrate's name for it
                scale.name = f"{module}.{fmt.fp8_scale_part}"
                dest.append(scale)
            elif not fmt.stores_head(ctx.recipe.lm_head.storage):
                dest.append(copied(src, t))
            else:
                dest += [_from_intermediate(head, f"{module}.{p}") for p in fmt.head_parts(*c.shape)]
        elif t.storage == "int4":
            dest += fmt.int4_tensors(src, t)
        else:
            dest.append(copied(src, t))
    shards = plan_shards(main, ctx.recipe.output.max_shard_bytes)
    for s in shards:  # the head's tensors last in their shard: the rest is written while it is quantized
        s.tensors.sort(key=lambda t: t.name in head)
    taken = {s.filename for s in shards}
    for f, tensors in sorted(extra.items()):
        if f in taken:
            raise ArtifactError(f"source file {f} collides with an output shard name")
        shards.append(ShardPlan(f, tensors))  # e.g. MTP: same file as the source, now listed in the index
    return shards


def check(ctx: BuildContext) -> None:
    ctx.recipe.output.fmt.check_source(ctx.source)


def quantization_config(ctx) -> dict:
    """The output format's ``quantization_config`` for what the plan converts."""
    fmt = ctx.recipe.output.fmt
    return fmt.quantization_config(
        ctx.source, [c.module for c in ctx.plan.of_kind("fp8")], [c.module for c in ctx.plan.of_kind("int8")],
        head_stored=fmt.stores_head(ctx.recipe.lm_head.storage))


def hybrid_block(ctx) -> dict:
    return {
        "format": ctx.recipe.output.format,
        "version": __version__,
        "recipe": ctx.recipe.name,
        "source": {k: v for k, v in ctx.source_record().to_provenance().items() if k != "files"},
        "fp8_modules": [c.module for c in ctx.plan.of_kind("fp8")],
        "fp8_block": [128, 128],
        "lm_head": ctx.recipe.output.fmt.head_label_for(ctx.recipe.lm_head.storage)
        if ctx.plan.of_kind("int8") else "unchanged",
    }


def _other_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_dir() or rel.parts[0].startswith(".") or p.name.endswith(".safetensors") or str(rel) in SKIP_COPY:
            continue
        if p.name.endswith(TMP_SUFFIX):
            continue
        out.append(p)
    return out


def inputs(ctx: BuildContext) -> dict:
    """The recipe sections that decide the checkpoint's bytes (its name is in config.json); the
    rest of the recipe (validate thresholds, serve profiles, publish settings) is ``record``'s."""
    r = ctx.recipe
    return {"name": r.name, "output": r.output.model_dump(mode="json"),
            "shared_experts": r.shared_experts.model_dump(mode="json"), "lm_head": r.lm_head.model_dump(mode="json")}


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    out = ctx.out
    fmt = ctx.recipe.output.fmt
    key = ctx.assemble_marker()  # decides whether half-written shards of an earlier try may be kept
    marker = ctx.work / "assemble.inprogress"
    resume = marker.exists() and marker.read_text() == key
    (out / INDEX_NAME).unlink(missing_ok=True)  # from here on the folder no longer looks complete
    (out / PROVENANCE).unlink(missing_ok=True)  # nor holds a provenance of other shards
    write_text_atomic(marker, key)
    shards = plan_output(ctx, io.up)
    planned = {s.filename for s in shards}
    for stale in out.glob("*.safetensors*"):
        if stale.name not in planned or not resume:
            stale.unlink()
    total = sum(s.data_bytes for s in shards)
    bar = ctx.progress(total=total, desc="assemble", unit="B", unit_scale=True)
    def write_hashed(plan: ShardPlan) -> str:
        hasher = ShardHasher()
        write_shard(plan, out, resume=resume, progress=bar.update, hasher=hasher)
        return hasher.hexdigest()

    # Each shard is hashed while it is written, so the provenance manifest needs no second read
    # (which would come from disk once the output outgrows the page cache). One sha256 stream
    # runs at ~1.3 GB/s a core, slower than the copy: two shards are written at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        shard_hashes = dict(zip((s.filename for s in shards), pool.map(write_hashed, shards)))
    for upstream in io.up.values():
        upstream.wait()  # a stage still in the background: its metrics go into the provenance

    for f in _other_files(ctx.source.root):
        copy_file_atomic(f, out / f.relative_to(ctx.source.root))
    config = copy.deepcopy(ctx.source.config)
    qc = quantization_config(ctx)
    config["quantization_config"] = qc
    config["hybrid_build"] = hybrid_block(ctx)
    write_text_atomic(out / CONFIG, json.dumps(config, indent=2) + "\n")
    if (ctx.source.root / "quantization_config.json").exists() or fmt.writes_quantization_config_file:
        write_text_atomic(out / QUANT_CONFIG, json.dumps(qc, indent=2) + "\n")

    weight_map = {t.name: s.filename for s in shards for t in s.tensors}
    index_text = json.dumps({"metadata": {"total_size": sum(s.data_bytes for s in shards)},
                             "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    os.sync()  # shards on disk before the files that say the build is complete
    ctx.record_location()
    checkpoint = checkpoint_record(ctx, shards, index_text, shard_hashes, io.up)
    write_text_atomic(out / INDEX_NAME, index_text)
    marker.unlink(missing_ok=True)
    hashes = {rel: info["sha256"] for rel, info in checkpoint["files"].items()}
    return [out / rel for rel in checkpoint["files"]], {"shards": [s.filename for s in shards], "bytes": total,
                                                         "_hashes": hashes, **checkpoint}


def checkpoint_record(ctx, shards: list[ShardPlan], index_text: str, known: dict[str, str],
                      up: dict[str, StageOutput]) -> dict:
    """What the provenance says of the checkpoint (``record`` adds the recipe and the source):
    every file with its size and sha256, the tensor counts and the converted modules. ``known``
    holds the sha256 of files hashed while writing, ``up`` the stage results whose metrics it records."""
    out = ctx.out
    files = {}
    for rel in build_outputs(out):  # never a report written after an earlier build (core.artifact)
        if rel in (INDEX_NAME, RECIPE):  # the index is written next; the recipe copy is record's
            continue
        p = out / rel
        files[rel] = {"bytes": p.stat().st_size, "sha256": known.get(rel) or sha256_file(p)}

    files[INDEX_NAME] = {"bytes": len(index_text.encode()), "sha256": hashlib.sha256(index_text.encode()).hexdigest()}
    metrics = {}
    for upstream in up.values():
        metrics.update(upstream.details.get("metrics", {}))
    converted = []
    for c in ctx.plan.conversions:
        names = [t.name for s in shards for t in s.tensors if split_module(t.name)[0] == c.module]
        converted.append({"module": c.module, "kind": c.kind, "shape": list(c.shape), "from": c.source.storage,
                          "tensors": names, "metrics": metrics.get(c.module)})
    n_out = sum(len(s.tensors) for s in shards)
    src = ctx.source
    return {
        "files": dict(sorted(files.items())),
        "tensors": {"total": n_out, "converted_modules": len(ctx.plan.conversions),
                    "copied": sum(1 for s in shards for t in s.tensors if isinstance(t.source, ByteRange)
                                  and t.source.path.is_relative_to(src.root))},
        "converted": converted,
    }


def writes(ctx: BuildContext) -> int:
    return output_bytes(ctx)


def describe(ctx: BuildContext, up: dict[str, StageOutput]) -> dict:
    return {"shards": [{"file": s.filename, "bytes": s.total_bytes, "tensors": len(s.tensors)}
                       for s in plan_output(ctx, up)]}


STAGE = Stage("assemble", run, inputs=inputs, reads=("calibrate", "quantize-head"), check=check, writes=writes,
              describe=describe)
