"""Which tensors a recipe converts, and the bytes before and after: decided from headers alone.

``plan_conversion`` is shared by ``inspect`` (what the default recipe would do), ``run`` (what
it will do) and ``plan`` (what it buys per decoded token).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybrid_build.core import formats
from hybrid_build.core.checkpoint import Checkpoint, TensorInfo
from hybrid_build.core.errors import SourceError
from hybrid_build.core.formats.base import OutputFormat
from hybrid_build.recipes.schema import Recipe, target_matches


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
    Only BF16/FP16/FP32 2-D ``weight`` tensors are candidates; anything already quantized stays.
    The bytes after are the recipe's output format's (``core/formats``)."""
    out: list[Conversion] = []
    fmt = recipe.output.fmt
    for module, parts in sorted(ckpt.modules.items()):
        w = parts.get("weight")
        if w is None or w.storage not in ("bf16", "fp16", "fp32") or len(w.shape) != 2:
            continue
        n, k = w.shape
        if recipe.shared_experts.enabled and w.klass == "shared_expert" and \
                target_matches(recipe.shared_experts.targets, module):
            out.append(Conversion(module, "fp8", w.klass, w, fmt.fp8_bytes(n, k)))
        elif recipe.lm_head.enabled and w.klass == "lm_head" and target_matches(recipe.lm_head.targets, module):
            if fmt.stores_head(recipe.lm_head.storage):
                _check_head_fits(fmt, module, n, k)
            out.append(Conversion(module, "int8", w.klass, w, fmt.head_bytes(n, k, recipe.lm_head.storage)))
    return ConversionPlan(recipe, out)


def _check_head_fits(fmt: OutputFormat, module: str, n: int, k: int) -> None:
    """A head the format cannot store is refused before anything is written, naming the ways out."""
    problem = fmt.head_problem(n, k)
    if problem is None:
        return
    others = [f.name for f in formats.REGISTRY.values() if f is not fmt and f.head_problem(n, k) is None]
    ways = ([f"use --format {' or '.join(others)}"] if others else []) + ["set lm_head.storage: bf16 in the recipe"]
    raise SourceError(f"{module}: {problem}; {', or '.join(ways)}")
