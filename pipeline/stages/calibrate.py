"""The ``calibrate`` stage: shared-expert projections -> FP8 E4M3 with a float32
``weight_scale_inv`` per 128x128 block, written to one intermediate safetensors file.

Each weight is read, quantized and written one tensor at a time (the file is planned first, its
producers run as the writer reaches them). With ``shared_experts.source: checkpoint`` the FP8
tensors are taken from Qwen's official FP8 checkpoint instead (``fp8_source``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybrid_build.calibration.fp8_block import dequantize_fp8_block, quantize_fp8_block
from hybrid_build.calibration.metrics import error_metrics
from hybrid_build.core.safetensors_io import OutTensor, ShardPlan, write_shard
from hybrid_build.core.weights import read_tensor
from hybrid_build.recipes.conversion import Conversion

from ..context import BuildContext
from .base import Stage, StageIO

FP8_FILE = "shared_experts_fp8.safetensors"


def inputs(ctx: BuildContext) -> dict:
    return {"shared_experts": ctx.recipe.shared_experts.model_dump(mode="json"),
            "modules": [c.module for c in ctx.plan.of_kind("fp8")]}


def check(ctx: BuildContext) -> None:
    from ..fp8_source import require_named

    require_named(ctx.recipe.shared_experts)


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    """Shared-expert projections -> FP8 E4M3 + float32 ``weight_scale_inv`` per 128x128 block."""
    convs = ctx.plan.of_kind("fp8")
    out = ctx.stage_dir("calibrate") / FP8_FILE
    spec = ctx.recipe.shared_experts
    metrics: dict[str, dict] = {}
    if spec.source == "checkpoint":
        from ..fp8_source import take_from_fp8_checkpoint

        tensors, metrics = take_from_fp8_checkpoint(ctx.source, convs, spec)
    else:
        pending: dict[str, torch.Tensor] = {}
        bar = ctx.progress(total=len(convs), desc="calibrate FP8", unit="tensor")

        def weight_bytes(c: Conversion):
            def produce():
                w = read_tensor(ctx.source, c.module + ".weight")
                q, s = quantize_fp8_block(w, observer=spec.observer)
                metrics[c.module] = error_metrics(w.float(), dequantize_fp8_block(q, s))
                pending[c.module] = s.contiguous()
                bar.update(1)
                yield q.view(torch.uint8).numpy().tobytes()
            return produce

        def scale_bytes(c: Conversion):
            def produce():
                yield pending.pop(c.module).numpy().tobytes()
            return produce

        tensors = []
        for c in convs:
            n, k = c.shape
            tensors.append(OutTensor(c.module + ".weight", "F8_E4M3", (n, k), weight_bytes(c)))
            tensors.append(OutTensor(c.module + ".weight_scale_inv", "F32",
                                     (-(-n // 128), -(-k // 128)), scale_bytes(c)))
    write_shard(ShardPlan(out.name, tensors), out.parent)
    return [out], {"metrics": metrics, "count": len(convs)}


# ---------------------------------------------------------------------------- quantize-head


def writes(ctx: BuildContext) -> int:
    return sum(c.out_bytes for c in ctx.plan.of_kind("fp8"))


STAGE = Stage("calibrate", run, inputs=inputs, check=check, writes=writes)
