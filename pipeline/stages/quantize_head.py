"""The ``quantize-head`` stage: lm-head -> int8 codes with per-row scales, in row chunks.

Its file's layout is known before a byte is computed (``head_plan``), so it can run in the
background while ``assemble`` writes the shards that do not hold the head.
"""
from __future__ import annotations

from pathlib import Path

from hybrid_build.core.progress import ProgressFactory, null_progress
from hybrid_build.core.safetensors_io import OutTensor, ShardPlan, write_shard

from ..context import BuildContext
from .base import Handover, Stage, StageIO

HEAD_FILE = "lm_head_int8.safetensors"
HEAD_CACHE_ROWS = 1024  # rows per quantizer step: 12 MB of float32 buffers at K = 3072


def inputs(ctx: BuildContext) -> dict:
    return {"lm_head": ctx.recipe.lm_head.model_dump(mode="json"), "format": ctx.recipe.output.format,
            "modules": [c.module for c in ctx.plan.of_kind("int8")]}


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    """The ``quantize-head`` stage: write the planned head file (``head_plan``).

    In the background for ``assemble`` (``io.handover`` set), the head's tensors are also handed to
    assemble in memory as soon as they are computed, so the output shard does not wait for this
    file, and the file is written with ``O_DIRECT`` (this process will not read it back). Run on
    its own, the file goes through the page cache, where assemble finds it later."""
    handover = io.handover if ctx.recipe.output.fmt.hands_over_head else None
    plan, details = head_plan(ctx, handover)
    if plan is None:
        return [], details
    out = ctx.stage_dir("quantize-head") / plan.filename
    write_shard(plan, out.parent, direct_io=handover is not None)
    return [out], details


def head_plan(ctx: BuildContext, handover: Handover | None = None,
              progress: ProgressFactory | None = None) -> tuple[ShardPlan | None, dict]:
    """The quantize-head file as a plan: its layout is known before a byte is computed (so
    ``assemble`` can plan the output while the head is being quantized), and writing it runs
    the quantization; ``details`` receives the metrics as the producers finish. ``handover``,
    if given, receives the head's tensors once computed (a format whose head streams row by row
    to its file does not hand over: ``OutputFormat.hands_over_head``).

    lm-head -> int8 codes with float per-row scales, in row chunks (bounded memory), laid out as
    the output format stores them (``OutputFormat.head_tensors``). Chunks are at most
    ``HEAD_CACHE_ROWS`` rows (fewer if the recipe's ``chunk_rows`` says so) so that the fused
    quantizer's buffers stay in cache. ``progress`` (default: the build's) makes the bars; a plan
    made only for its layout, never written, takes ``null_progress`` and draws none."""
    convs = ctx.plan.of_kind("int8")
    spec = ctx.recipe.lm_head
    fmt = ctx.recipe.output.fmt
    if not fmt.stores_head(spec.storage) or not convs:
        return None, {"storage": spec.storage, "note": "lm-head left BF16; quantized at load time by the serve plugin"}
    details: dict = {"storage": spec.storage, "metrics": {}}
    tensors: list[OutTensor] = []
    chunk = min(spec.chunk_rows, HEAD_CACHE_ROWS)
    for c in convs:
        n, k = c.shape
        bar = (progress or ctx.progress)(total=n, desc=f"quantize {c.module}", unit="row")
        tensors += fmt.head_tensors(ctx.source, c.module, n, k, chunk, bar, details["metrics"],
                                    handover.put if handover is not None else None)
    return ShardPlan(HEAD_FILE, tensors), details


def layout(ctx: BuildContext) -> ShardPlan | None:
    return head_plan(ctx, progress=null_progress)[0]


def writes(ctx: BuildContext) -> int:
    if not ctx.recipe.output.fmt.stores_head(ctx.recipe.lm_head.storage):
        return 0
    return sum(c.out_bytes for c in ctx.plan.of_kind("int8"))


STAGE = Stage("quantize-head", run, inputs=inputs, background=True, layout=layout, writes=writes)
