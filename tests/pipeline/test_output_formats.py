"""Each output format's promises against the artifact assemble actually wrote: the tensors of
every converted and repacked module, their bytes (what ``plan`` counts), and the config."""
from __future__ import annotations

import json

import pytest

from hybrid_build.core import formats
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.formats.base import parts_bytes
from hybrid_build.core.tensor_classes import split_module
from hybrid_build.recipes.conversion import plan_conversion
from hybrid_build.recipes.schema import load_recipe


@pytest.fixture(params=["inc_artifact", "ct_artifact"])
def built(request, tiny_checkpoint):
    """(format, artifact, source, plan) for each artifact the session builds."""
    art = Checkpoint.read_folder(request.getfixturevalue(request.param))
    fmt = formats.get(art.hybrid_info["format"])
    recipe = load_recipe("tiny")
    recipe.output.format = fmt.name
    src = Checkpoint.read_folder(tiny_checkpoint)
    return fmt, art, src, plan_conversion(src, recipe)


def _parts(art: Checkpoint, module: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {split_module(t.name)[1]: (t.dtype, tuple(t.shape)) for t in art.tensors.values()
            if split_module(t.name)[0] == module}


def test_converted_tensors_and_bytes_are_the_formats(built):
    fmt, art, src, plan = built
    assert plan.of_kind("fp8") and plan.of_kind("int8")
    for c in plan.conversions:
        n, k = c.shape
        want = fmt.fp8_parts(n, k) if c.kind == "fp8" else fmt.head_parts(n, k)
        assert _parts(art, c.module) == want, c.module
        written = sum(t.nbytes for t in art.tensors.values() if split_module(t.name)[0] == c.module)
        assert written == c.out_bytes == parts_bytes(want), c.module


def test_int4_modules_are_carried_as_the_format_says(built):
    fmt, art, src, plan = built
    converted = {c.module for c in plan.conversions}
    int4 = [m for m, parts in src.modules.items() if m not in converted and "qweight" in parts]
    assert int4
    for module in int4:
        repacked = fmt.int4_parts(src.modules[module])
        if repacked is None:  # copied: the source's parts, dtypes and shapes
            repacked = {p: (t.dtype, tuple(t.shape)) for p, t in src.modules[module].items()}
        assert _parts(art, module) == repacked, module


def test_config_declares_what_was_written(built):
    fmt, art, src, plan = built
    fp8 = [c.module for c in plan.of_kind("fp8")]
    heads = [c.module for c in plan.of_kind("int8")]
    assert fmt.config_problems(art.quant, fp8, heads)[0] == []
    assert art.hybrid_info["lm_head"] == fmt.head_label
    other = next(f for f in formats.REGISTRY.values() if f is not fmt)
    assert other.config_problems(art.quant, fp8, heads)[0]  # the other format's reader refuses it
    qc_file = art.root / "quantization_config.json"
    if fmt.writes_quantization_config_file:
        assert json.loads(qc_file.read_text()) == art.config["quantization_config"]
