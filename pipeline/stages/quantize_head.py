"""The ``quantize-head`` stage: lm-head -> int8 codes with per-row scales, in row chunks.

Its file's layout is known before a byte is computed (``head_plan``), so it can run in the
background while ``assemble`` writes the shards that do not hold the head.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybrid_build.calibration.gptq import int8_gptq_qzeros
from hybrid_build.calibration.int8_rows import RowChunkQuantizer

from ..context import BuildContext
from hybrid_build.core.safetensors_io import OutTensor, ShardPlan, write_shard
from hybrid_build.core.weights import iter_row_chunks
from .base import Handover, Stage, StageIO

HEAD_FILE = "lm_head_int8.safetensors"
HEAD_CACHE_ROWS = 1024  # rows per quantizer step: 12 MB of float32 buffers at K = 3072


def inputs(ctx: BuildContext) -> dict:
    return {"lm_head": ctx.recipe.lm_head.model_dump(mode="json"), "format": ctx.recipe.output.format,
            "modules": [c.module for c in ctx.plan.of_kind("int8")]}


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    """The ``quantize-head`` stage: write the planned head file (``head_plan``).

    In the background for ``assemble`` (``io.handover`` set), the GPTQ tensors are also handed to
    assemble in memory as soon as they are computed, so the output shard does not wait for this
    file, and the file is written with ``O_DIRECT`` (this process will not read it back). Run on
    its own, the file goes through the page cache, where assemble finds it later."""
    handover = io.handover if ctx.recipe.output.format != "compressed-tensors" else None
    plan, details = head_plan(ctx, handover)
    if plan is None:
        return [], details
    out = ctx.stage_dir("quantize-head") / plan.filename
    write_shard(plan, out.parent, direct_io=handover is not None)
    return [out], details


def head_plan(ctx: BuildContext, handover: Handover | None = None) -> tuple[ShardPlan | None, dict]:
    """The quantize-head file as a plan: its layout is known before a byte is computed (so
    ``assemble`` can plan the output while the head is being quantized), and writing it runs
    the quantization; ``details`` receives the metrics as the producers finish. ``handover``,
    if given, receives the GPTQ tensors once computed (compressed-tensors streams its codes).

    lm-head -> int8 codes with float per-row scales, in row chunks (bounded memory).

    ``gptq-int8`` stores ``qweight`` int32 [K/4, N], which interleaves all rows, so the packed
    words are gathered in memory (N*K bytes, 763 MB for the real head) and written at the end;
    compressed-tensors' row-major int8 is streamed chunk by chunk. Chunks are at most
    ``HEAD_CACHE_ROWS`` rows (fewer if the recipe's ``chunk_rows`` says so) so that the fused
    quantizer's buffers stay in cache."""
    convs = ctx.plan.of_kind("int8")
    spec = ctx.recipe.lm_head
    if spec.storage == "bf16" or not convs:
        return None, {"storage": spec.storage, "note": "lm-head left BF16; quantized at load time by the serve plugin"}
    fmt = ctx.recipe.output.format
    details: dict = {"storage": spec.storage, "metrics": {}}
    tensors: list[OutTensor] = []
    chunk = min(spec.chunk_rows, HEAD_CACHE_ROWS)
    for c in convs:
        n, k = c.shape
        bar = ctx.progress(total=n, desc=f"quantize {c.module}", unit="row")
        if fmt == "compressed-tensors":
            # weight-only int8 is compressed-tensors "pack-quantized" at 8 bits: codes + 128, four
            # to an int32 along K. Row-major, so it streams chunk by chunk (vLLM 0.25 rejects an
            # "int-quantized" int8 weight without int8 activations).
            scales = torch.empty((n, 1), dtype=torch.float32)
            qz = RowChunkQuantizer(k, min(chunk, n), torch.float32)

            def rows(c=c, scales=scales, qz=qz, bar=bar):
                for lo, w in iter_row_chunks(ctx.source, c.module + ".weight", chunk):
                    words, s = qz(w)
                    scales[lo:lo + w.shape[0], 0] = s
                    bar.update(w.shape[0])
                    yield _raw(words)
                details["metrics"][c.module] = qz.metrics.result()

            shape = torch.tensor([n, k], dtype=torch.int64)
            tensors.append(OutTensor(c.module + ".weight_packed", "I32", (n, k // 4), rows))
            tensors.append(OutTensor(c.module + ".weight_scale", "F32", (n, 1), lambda s=scales: iter([_raw(s)])))
            tensors.append(OutTensor(c.module + ".weight_shape", "I64", (2,), lambda s=shape: iter([_raw(s)])))
        else:
            # qweight comes first in the file and interleaves all rows: its producer quantizes
            # the whole head, then the scales' producer yields what it left behind
            scales16 = torch.empty((1, n), dtype=torch.float16)
            zeros = int8_gptq_qzeros(n)

            def qweight_bytes(c=c, n=n, k=k, scales16=scales16, zeros=zeros, bar=bar):
                qweight = torch.empty((k // 4, n), dtype=torch.int32)
                qz = RowChunkQuantizer(k, min(chunk, n), torch.float16)  # GPTQ scales are fp16
                for lo, w in iter_row_chunks(ctx.source, c.module + ".weight", chunk):
                    hi = lo + w.shape[0]
                    words, s16 = qz(w)
                    for j in range(0, hi - lo, 64):  # transposed in 64-row blocks: 2.5x faster than at once
                        qweight[:, lo + j:min(hi, lo + j + 64)] = words[j:j + 64].t()
                    scales16[0, lo:hi] = s16
                    bar.update(hi - lo)
                details["metrics"][c.module] = qz.metrics.result()
                if handover is not None:
                    handover.put({c.module + ".qweight": qweight, c.module + ".qzeros": zeros,
                                  c.module + ".scales": scales16})
                yield _raw(qweight)

            tensors.append(OutTensor(c.module + ".qweight", "I32", (k // 4, n), qweight_bytes))
            tensors.append(OutTensor(c.module + ".qzeros", "I32", tuple(zeros.shape), lambda z=zeros: iter([_raw(z)])))
            tensors.append(OutTensor(c.module + ".scales", "F16", (1, n), lambda s=scales16: iter([_raw(s)])))
    return ShardPlan(HEAD_FILE, tensors), details


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (``tobytes`` would double the 763 MB packed head)."""
    return memoryview(t.contiguous().numpy()).cast("B")


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (``tobytes`` would double the 763 MB packed head)."""
    return memoryview(t.contiguous().numpy()).cast("B")


def layout(ctx: BuildContext) -> ShardPlan | None:
    return head_plan(ctx)[0]


def writes(ctx: BuildContext) -> int:
    return 0 if ctx.recipe.lm_head.storage == "bf16" else sum(c.out_bytes for c in ctx.plan.of_kind("int8"))


STAGE = Stage("quantize-head", run, inputs=inputs, background=True, layout=layout, writes=writes)
