"""`--fp8-source`: shared experts taken from an official-style FP8 checkpoint by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hybrid_build.calibration.fp8_block import quantize_fp8_block
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import SourceError
from hybrid_build.core.weights import read_tensor
from hybrid_build.pipeline.build import prepare
from hybrid_build.pipeline.runner import run_build
from hybrid_build.pipeline.stages import STAGES


@pytest.fixture(scope="module")
def official_fp8(tiny_checkpoint, tmp_path_factory):
    """A folder laid out as Qwen's FP8 release stores shared experts (weight + weight_scale_inv,
    block 128), quantized with the MSE observer so that it differs from local min-max calibration."""
    src = Checkpoint.read_folder(tiny_checkpoint)
    out = tmp_path_factory.mktemp("fp8") / "official"
    out.mkdir()
    tensors = {}
    for t in (t for t in src.tensors.values() if t.klass == "shared_expert"):
        module = t.name[: -len(".weight")]
        q, s = quantize_fp8_block(read_tensor(src, t.name), observer="mse")
        tensors[module + ".weight"], tensors[module + ".weight_scale_inv"] = q, s
    save_file(tensors, out / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}))
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _build(source, out, fp8_dir):
    ctx = prepare(source, out, "tiny")
    ctx.recipe.shared_experts.source = "checkpoint"
    ctx.recipe.shared_experts.fp8_checkpoint = str(fp8_dir)
    return ctx, run_build(ctx, [s for s in STAGES if s != "validate"])


def test_tensors_come_from_the_official_checkpoint(tiny_checkpoint, official_fp8, tmp_path):
    ctx, results = _build(tiny_checkpoint, tmp_path / "out", official_fp8)
    art, fp8 = Checkpoint.read_folder(tmp_path / "out"), Checkpoint.read_folder(official_fp8)
    for t in fp8.tensors.values():
        assert torch.equal(read_tensor(art, t.name).view(torch.uint8), read_tensor(fp8, t.name).view(torch.uint8))
    metrics = next(r for r in results if r.stage == "calibrate").details["metrics"]
    assert len(metrics) == 12
    for m in metrics.values():
        assert 0.018 < m["rel_error"] < 0.032 and 0.018 < m["local_rel_error"] < 0.032
        assert m["official_vs_local_rel_diff"] > 0  # MSE and min-max scales differ somewhere


def test_shape_mismatch_is_named(tiny_checkpoint, official_fp8, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(official_fp8, bad)
    shard = bad / "model-00001-of-00001.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(shard)
    name = "model.language_model.layers.2.mlp.shared_expert.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1].clone()
    save_file(tensors, shard)
    with pytest.raises(SourceError, match="layers.2.mlp.shared_expert.down_proj.weight_scale_inv is F32"):
        _build(tiny_checkpoint, tmp_path / "out", bad)


def test_missing_checkpoint_name_is_a_recipe_problem(tiny_checkpoint, tmp_path):
    ctx = prepare(tiny_checkpoint, tmp_path / "out", "tiny")
    ctx.recipe.shared_experts.source = "checkpoint"
    with pytest.raises(SourceError, match="no fp8_checkpoint is named"):
        run_build(ctx, ["inspect", "calibrate"])
