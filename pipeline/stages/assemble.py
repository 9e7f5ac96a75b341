"""The ``assemble`` stage: write the output checkpoint from the source and the stage results.

Every output tensor is planned first (names, dtypes, shapes, shard offsets). Unchanged tensors
are byte ranges of the source; converted ones are byte ranges of the intermediate files written
by ``calibrate`` and ``quantize-head``; only the compressed-tensors INT4 repack transposes data,
one tensor at a time. Shards go to temporary names and are renamed when complete; the index is
written last, after the provenance manifest, so a folder with an index is a complete build.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybrid_build.calibration.gptq import zeros_are_symmetric

from hybrid_build.core import __version__
from hybrid_build.core.checkpoint import TensorInfo
from ..context import BuildContext, output_bytes
from hybrid_build.core.errors import ArtifactError
from hybrid_build.core.tensor_classes import split_module
from hybrid_build.core.manifest import sha256_file
from hybrid_build.core.safetensors_io import (
    INDEX_NAME, TMP_SUFFIX, ByteRange, OutTensor, ShardHasher, ShardPlan, plan_shards, write_shard, write_text_atomic,
)
from hybrid_build.core.source_identity import LOCATION_FILE
from hybrid_build.core.weights import read_tensor
from .base import Stage, StageIO, StageOutput

log = logging.getLogger(__name__)

META_DIR = "hybrid_build"
PROVENANCE = f"{META_DIR}/provenance.json"
RECIPE_FILE = f"{META_DIR}/recipe.yaml"
FP8_EXTRA = {"bits": 8, "data_type": "fp", "weight_block_size": [128, 128], "act_data_type": "fp", "act_dynamic": True}
INT8_HEAD_EXTRA = {"bits": 8, "group_size": -1, "sym": True, "data_type": "int"}
SKIP_COPY = {"config.json", "quantization_config.json", INDEX_NAME}


def _copy(t: TensorInfo, ctx, name: str | None = None) -> OutTensor:
    return OutTensor(name or t.name, t.dtype, t.shape, ByteRange(ctx.source.path_of(t), t.start, t.nbytes))


def _from_intermediate(entries: dict, name: str) -> OutTensor:
    if name not in entries:
        raise ArtifactError(f"intermediate result lacks {name}: run the earlier stages again (--from calibrate)")
    th, rng = entries[name]
    return OutTensor(name, th.dtype, th.shape, rng)


def _transposed(ctx, t: TensorInfo, name: str) -> OutTensor:
    def produce():
        yield read_tensor(ctx.source, t.name).t().contiguous().numpy().tobytes()
    return OutTensor(name, t.dtype, (t.shape[1], t.shape[0]), produce)


def plan_output(ctx: BuildContext, up: dict[str, StageOutput]) -> list[ShardPlan]:
    """Every output file with its tensors, in source order; nothing is read but headers. The
    converted tensors come from ``up``: calibrate's file, and quantize-head's (finished, or still
    running in the background with its layout known)."""
    fmt = ctx.recipe.output.format
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
                scale = _from_intermediate(fp8, module + ".weight_scale_inv")
                if fmt == "compressed-tensors":
                    scale.name = module + ".weight_scale"
                dest.append(scale)
            elif ctx.recipe.lm_head.storage == "bf16":
                dest.append(_copy(t, ctx))
            elif fmt == "compressed-tensors":
                dest += [_from_intermediate(head, f"{module}.{p}") for p in ("weight_packed", "weight_scale", "weight_shape")]
            else:
                dest += [_from_intermediate(head, f"{module}.{p}") for p in ("qweight", "qzeros", "scales")]
        elif fmt == "compressed-tensors" and t.storage == "int4":
            if part == "qweight":
                dest.append(_transposed(ctx, t, module + ".weight_packed"))
                scales = src.tensors[module + ".scales"]
                dest.append(_transposed(ctx, scales, module + ".weight_scale"))
                k = t.shape[0] * 8
                shape = torch.tensor([t.shape[1], k], dtype=torch.int64)
                dest.append(OutTensor(module + ".weight_shape", "I64", (2,), lambda s=shape: iter([s.numpy().tobytes()])))
            elif part not in ("scales", "qzeros"):
                dest.append(_copy(t, ctx))
        else:
            dest.append(_copy(t, ctx))
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
    if ctx.recipe.output.format == "compressed-tensors":
        check_int4_symmetric(ctx)


def check_int4_symmetric(ctx) -> None:
    """compressed-tensors repack is bit-exact only for symmetric zeros (every word 0x77777777)."""
    for module, parts in ctx.source.modules.items():
        if "qzeros" in parts and parts["qweight"].storage == "int4":
            if not zeros_are_symmetric(read_tensor(ctx.source, module + ".qzeros"), 4):
                raise ArtifactError(f"{module}: asymmetric INT4 zeros; compressed-tensors repack needs symmetric GPTQ")


def _regex_for(modules: list[str], prefix: str) -> list[str]:
    """Generalise module names over layer and expert indices into compressed-tensors ``re:``
    targets. The language-model prefix is replaced by ``.*`` because engines rename it (vLLM's
    VL class calls it ``language_model.model.``)."""
    pats = sorted({re.sub(r"\\\.(\d+)\\\.", r"\\.\\d+\\.", re.escape(m[len(prefix):] if m.startswith(prefix) else m))
                   for m in modules})
    return [f"re:.*{p}$" for p in pats]


def quantization_config(ctx) -> dict:
    src_q = copy.deepcopy(ctx.source.quant.raw)
    fp8_modules = [c.module for c in ctx.plan.of_kind("fp8")]
    head_modules = [c.module for c in ctx.plan.of_kind("int8")]
    if ctx.recipe.output.format == "inc-hybrid":
        extra = src_q.setdefault("extra_config", {})
        for key in [k for k in extra if any(c in k for c in "*+?^$()[]{}|\\") and
                    any(re.search(k, m) for m in fp8_modules + head_modules)]:
            del extra[key]  # a regex 16-bit entry for converted layers would contradict the exact ones
        for m in fp8_modules:
            extra[m] = dict(FP8_EXTRA)
        if ctx.recipe.lm_head.storage == "gptq-int8":
            for m in head_modules:
                extra[m] = dict(INT8_HEAD_EXTRA)
        return src_q
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    int4 = sorted({split_module(t.name)[0] for t in ctx.source.tensors.values()
                   if t.storage == "int4" and t.name.endswith(".qweight")})
    groups = {
        "int4": QuantizationScheme(targets=_regex_for(int4, ctx.source.lm_prefix), format="pack-quantized", weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=ctx.source.quant.group_size or 128)),
        "fp8": QuantizationScheme(targets=_regex_for(fp8_modules, ctx.source.lm_prefix), format="float-quantized", weights=QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
            input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                               group_size=128, dynamic=True)),
    }
    if head_modules and ctx.recipe.lm_head.storage != "bf16":
        groups["int8_head"] = QuantizationScheme(
            targets=["re:.*lm_head$"], format="pack-quantized",
            weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"))
    qc = QuantizationConfig(config_groups=groups, format="mixed-precision", quantization_status="compressed",
                            ignore=["re:.*mtp\\..*", "re:.*visual\\..*"])
    return qc.model_dump(mode="json", exclude_none=True)


def hybrid_block(ctx) -> dict:
    return {
        "format": ctx.recipe.output.format,
        "version": __version__,
        "recipe": ctx.recipe.name,
        "source": {k: v for k, v in ctx.source_record().to_provenance().items() if k != "files"},
        "fp8_modules": [c.module for c in ctx.plan.of_kind("fp8")],
        "fp8_block": [128, 128],
        "lm_head": ("quantize-at-load" if ctx.recipe.lm_head.storage == "bf16" else
                    "int8-channel" if ctx.recipe.output.format == "compressed-tensors" else "gptq-int8")
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


def _copy_file_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + TMP_SUFFIX)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def inputs(ctx: BuildContext) -> dict:
    return {"recipe": ctx.recipe.model_dump(mode="json", by_alias=True)}


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    out = ctx.out
    fmt = ctx.recipe.output.format
    key = ctx.assemble_marker()  # decides whether half-written shards of an earlier try may be kept
    marker = ctx.work / "assemble.inprogress"
    resume = marker.exists() and marker.read_text() == key
    (out / INDEX_NAME).unlink(missing_ok=True)  # from here on the folder no longer looks complete
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
        _copy_file_atomic(f, out / f.relative_to(ctx.source.root))
    config = copy.deepcopy(ctx.source.config)
    qc = quantization_config(ctx)
    config["quantization_config"] = qc
    config["hybrid_build"] = hybrid_block(ctx)
    write_text_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    if (ctx.source.root / "quantization_config.json").exists() or fmt == "inc-hybrid":
        write_text_atomic(out / "quantization_config.json", json.dumps(qc, indent=2) + "\n")
    (out / META_DIR).mkdir(exist_ok=True)
    write_text_atomic(out / RECIPE_FILE, ctx.recipe.to_yaml())

    weight_map = {t.name: s.filename for s in shards for t in s.tensors}
    index_text = json.dumps({"metadata": {"total_size": sum(s.data_bytes for s in shards)},
                             "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    os.sync()  # shards on disk before the files that say the build is complete
    record = ctx.source_record()
    write_text_atomic(ctx.work / LOCATION_FILE, json.dumps(record.to_location(), indent=2) + "\n")
    prov = provenance(ctx, shards, index_text, shard_hashes, record, io.up)
    write_text_atomic(out / PROVENANCE, json.dumps(prov, indent=2) + "\n")
    write_text_atomic(out / INDEX_NAME, index_text)
    marker.unlink(missing_ok=True)
    hashes = {rel: info["sha256"] for rel, info in prov["files"].items()}
    paths = [out / rel for rel in prov["files"]] + [out / PROVENANCE]
    return paths, {"shards": [s.filename for s in shards], "bytes": total, "_hashes": hashes,
                   "tensors": prov["tensors"]}


def artifact_files(out: Path) -> list[Path]:
    """Files the provenance manifest covers: all but itself, the validation report and work dirs."""
    files = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if p.is_dir() or rel.parts[0].startswith(".") or p.name.endswith(TMP_SUFFIX):
            continue
        if str(rel) == PROVENANCE or (rel.parts[0] == META_DIR and p.name.startswith("validation.")):
            continue
        files.append(p)
    return files


def provenance(ctx, shards: list[ShardPlan], index_text: str, known: dict[str, str], record,
               up: dict[str, StageOutput]) -> dict:
    """The manifest of the artifact; ``known`` holds sha256 of files hashed while writing,
    ``record`` is the source's identity (``source_identity.SourceRecord``), ``up`` the stage
    results whose metrics it records."""
    out = ctx.out
    files = {}
    for p in artifact_files(out):
        rel = str(p.relative_to(out))
        if rel == INDEX_NAME:
            continue
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
        "schema_version": 2,  # 2: the source is identified by content (kind, per-file sha256)
        "tool": {"name": "hybrid-build", "version": __version__},
        "format": ctx.recipe.output.format,
        "source": record.to_provenance(),
        "recipe": ctx.recipe.model_dump(mode="json", by_alias=True),
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
