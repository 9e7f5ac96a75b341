"""Which tensors a recipe converts, and the bytes before and after: decided from headers alone.

``plan_conversion`` is shared by ``inspect`` (what the default recipe would do), ``run`` (what
it will do) and ``plan`` (what it buys per decoded token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid_build.recipes.schema import Recipe, target_matches

from hybrid_build.core.checkpoint import Checkpoint, TensorInfo
from hybrid_build.core.errors import SourceError

FP8_BLOCK = 128


@dataclass(frozen=True)
class Conversion:
    module: str
    kind: str  # "fp8" (shared experts) | "int8" (lm-head)
    klass: str
    source: TensorInfo  # the BF16 ``<module>.weight``
    out_bytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.source.shape  # type: ignore[return-value]

    @property
    def in_bytes(self) -> int:
        return self.source.nbytes

    def to_json(self) -> dict:
        return {"module": self.module, "kind": self.kind, "class": self.klass, "shape": list(self.shape),
                "bytes_before": self.in_bytes, "bytes_after": self.out_bytes}


def fp8_block_bytes(n: int, k: int, block: int = FP8_BLOCK) -> int:
    """FP8 weight plus one float32 ``weight_scale_inv`` per [block, block] tile."""
    return n * k + math.ceil(n / block) * math.ceil(k / block) * 4


def int8_row_bytes(n: int, k: int, storage: str, fmt: str) -> int:
    if storage == "bf16":
        return n * k * 2
    if fmt == "compressed-tensors":
        return n * k + n * 4 + 16  # 8-bit pack-quantized codes + float32 per-row scale + weight_shape
    # GPTQ 8-bit: qweight int32 [K/4, N], scales fp16 [1, N], qzeros int32 [1, N/4]
    return n * k + n * 2 + n


@dataclass
class ConversionPlan:
    recipe: Recipe
    conversions: list[Conversion]

    def of_kind(self, kind: str) -> list[Conversion]:
        return [c for c in self.conversions if c.kind == kind]

    @property
    def bytes_before(self) -> int:
        return sum(c.in_bytes for c in self.conversions)

    @property
    def bytes_after(self) -> int:
        return sum(c.out_bytes for c in self.conversions)

    def to_json(self) -> dict:
        return {"recipe": self.recipe.name, "format": self.recipe.output.format,
                "conversions": [c.to_json() for c in self.conversions],
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "bytes_saved": self.bytes_before - self.bytes_after}


def plan_conversion(ckpt: Checkpoint, recipe: Recipe) -> ConversionPlan:
    """The shared-expert projections and the lm-head that ``recipe`` converts in ``ckpt``.
    Only BF16/FP16/FP32 2-D ``weight`` tensors are candidates; anything already quantized stays."""
    out: list[Conversion] = []
    fmt = recipe.output.format
    for module, parts in sorted(ckpt.modules.items()):
        w = parts.get("weight")
        if w is None or w.storage not in ("bf16", "fp16", "fp32") or len(w.shape) != 2:
            continue
        n, k = w.shape
        if recipe.shared_experts.enabled and w.klass == "shared_expert" and target_matches(recipe.shared_experts.targets, module):
            out.append(Conversion(module, "fp8", w.klass, w, fp8_block_bytes(n, k)))
        elif recipe.lm_head.enabled and w.klass == "lm_head" and target_matches(recipe.lm_head.targets, module):
            if recipe.lm_head.storage == "gptq-int8" and fmt != "compressed-tensors" and (n % 4 or k % 4):
                raise SourceError(f"{module}: the recipe's lm_head storage gptq-int8 packs 4 values to an int32 and needs "
                                  f"rows and columns divisible by 4, the shape is {n}x{k}; use --format "
                                  f"compressed-tensors, or set lm_head.storage: bf16 in the recipe")
            out.append(Conversion(module, "int8", w.klass, w, int8_row_bytes(n, k, recipe.lm_head.storage, fmt)))
    return ConversionPlan(recipe, out)
