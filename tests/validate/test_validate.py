"""``hybrid-build validate`` on a real tiny build: a clean artifact passes, and each planted
defect fails with exit 1 and a line naming the broken tensor or file and the metric."""
from __future__ import annotations

import json
import math

import pytest
import torch

from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.stages import STAGES
from hybrid_build.validate.report import validate_artifact

SE = "model.language_model.layers.{}.mlp.shared_expert.{}_proj"


def _validate(artifact, source, capsys, *extra):
    rc = main(["validate", str(artifact), "--source", str(source), "--json", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_clean_build_passes_with_end_to_end(built_artifact, tiny_checkpoint, test_recipe, tmp_path, capsys):
    import shutil

    art = tmp_path / "hybrid"
    shutil.copytree(built_artifact, art)
    rc, rep = _validate(art, tiny_checkpoint, capsys)
    assert rc == 0, rep["failures"]
    assert rep["passed"] and rep["failures"] == []
    assert {c["name"] for c in rep["checks"]} >= {"index", "provenance", "tensors", "scheme", "finite", "weights",
                                                  "activations", "lm_head", "end_to_end"}
    t = rep["thresholds"]
    fp8 = [w for w in rep["weights"] if w["kind"] == "fp8"]
    assert len(fp8) == 12  # 4 layers x gate/up/down
    for w in fp8:  # E4M3 block-128 on Gaussian weights: ~0.026, each block under 2^-4
        assert 0.015 < w["rel_error"] < t["fp8_max_rel_error"]
        assert w["max_block_rel_error"] < 0.0625
    head = next(w for w in rep["weights"] if w["kind"] == "int8")
    assert 0.003 < head["rel_error"] < t["int8_max_rel_error"]
    assert head["max_row_rel_error"] < math.sqrt(256) / 254  # symmetric per-row int8 bound, K = 256
    assert len(rep["activations"]) == 4
    assert all(a["rel_error"] < t["mlp_max_rel_error"] for a in rep["activations"])
    e2e = rep["end_to_end"]
    assert e2e["engine"] == "streamed" and e2e["tokens"] > 300
    assert 0 < e2e["kl"] < t["e2e_max_kl"]
    assert e2e["kl_median"] <= e2e["kl_p99"] <= e2e["kl_p999"] <= e2e["kl_max"]
    assert e2e["kl_ci95"][0] <= e2e["kl"] <= e2e["kl_ci95"][1]
    assert abs(e2e["ppl_change"]) < t["e2e_max_ppl_change"]
    assert e2e["top1_agreement"] >= t["e2e_min_top1"]
    # a random 1024-token model: perplexity near the vocabulary size
    assert 500 < e2e["ppl_source"] < 2000
    print("\nend to end (tiny):", {k: e2e[k] for k in ("tokens", "kl", "kl_p99", "kl_max", "top1_agreement",
                                                        "ppl_source", "ppl_hybrid", "ppl_change")})
    folder = art / "hybrid_build"
    assert json.loads((folder / "validation.json").read_text())["passed"] is True
    md = (folder / "validation.md").read_text()
    assert "## Validation: passed" in md and "End to end" in md
    assert (folder / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_block_scale_times_four_is_caught(artifact_copy, tiny_checkpoint, plant, capsys):
    module = SE.format(1, "down")
    plant.patch(artifact_copy, module + ".weight_scale_inv", lambda s: s.index_put_((torch.tensor(1), torch.tensor(0)),
                                                                                     s[1, 0] * 4))
    rc, rep = _validate(artifact_copy, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1 and not rep["passed"]
    weight_lines = [f for f in rep["failures"] if f.startswith("weights:") and module in f]
    assert any("block [1, 0] relative error" in f and "fp8_max_block_rel_error" in f
               for f in weight_lines), weight_lines
    # a x4 scale makes that block 4x too large: block error 3, tensor error 3 / sqrt(4 blocks)
    entry = next(w for w in rep["weights"] if w["module"] == module)
    assert entry["max_block_rel_error"] == pytest.approx(3.0, rel=0.01)
    assert entry["worst_block"] == [1, 0]
    assert any(f.startswith("activations:") and "layers.1.mlp.shared_expert" in f for f in rep["failures"])
    # only that tensor's numerics are off
    assert [w["module"] for w in rep["weights"] if not w["passed"]] == [module]
    assert any(f.startswith("provenance:") and "sha256" in f for f in rep["failures"])


def test_swapped_lm_head_rows_are_caught(artifact_copy, tiny_checkpoint, plant, capsys):
    a, b = 10, 700

    def swap_cols(t):
        t[:, [a, b]] = t[:, [b, a]]
        return t

    plant.patch(artifact_copy, "lm_head.qweight", swap_cols)  # rows of W are columns of qweight
    plant.patch(artifact_copy, "lm_head.scales", swap_cols)
    rc, rep = _validate(artifact_copy, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1
    head = [f for f in rep["failures"] if f.startswith("weights: lm_head")]
    assert any("int8_max_row_rel_error" in f and f"[{a}, {b}]" in f for f in head), head
    # two foreign rows of 1024 in the whole tensor: relative error ~ sqrt(2 * 2 / 1024) = 0.0625
    assert any("int8_max_rel_error" in f for f in head)
    entry = next(w for w in rep["weights"] if w["module"] == "lm_head")
    assert entry["worst_row"] in (a, b) and entry["max_row_rel_error"] > 1.0


def test_tensor_deleted_from_shard_is_caught(artifact_copy, tiny_checkpoint, plant, capsys):
    name = SE.format(2, "up") + ".weight_scale_inv"
    shard = plant.delete(artifact_copy, name)
    rc, rep = _validate(artifact_copy, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1
    fails = rep["failures"]
    assert any(f.startswith("index:") and name in f and shard.name in f for f in fails), fails
    assert any(f.startswith("tensors:") and name in f and "missing" in f for f in fails)
    assert any(SE.format(2, "up") in f and "cannot be checked" in f for f in fails)


def test_truncated_shard_is_caught(artifact_copy, tiny_checkpoint, plant, capsys):
    path, start, nbytes = plant.locate(artifact_copy, SE.format(0, "gate") + ".weight")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    rc, rep = _validate(artifact_copy, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1
    fails = rep["failures"]
    assert any(f.startswith("index:") and path.name in f and "truncated" in f for f in fails), fails
    assert any(f.startswith("provenance:") and path.name in f for f in fails)
    assert any(f.startswith("tensors:") and path.name in f and "cannot be read" in f for f in fails)


def test_nan_scale_is_named(artifact_copy, tiny_checkpoint, plant, capsys):
    name = SE.format(3, "gate") + ".weight_scale_inv"
    plant.patch(artifact_copy, name, lambda s: s.index_put_((torch.tensor(0), torch.tensor(1)), torch.tensor(math.nan)))
    rc, rep = _validate(artifact_copy, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1
    assert f"finite: {name}: 1 NaN scale value(s)" in rep["failures"]
    module = SE.format(3, "gate")
    assert any(f.startswith(f"weights: {module}: relative error nan") for f in rep["failures"]), rep["failures"]
    entry = next(w for w in rep["weights"] if w["module"] == module)
    assert entry["rel_error"] == "NaN"  # JSON has no NaN: written as a string
    assert (artifact_copy / "hybrid_build" / "validation.md").read_text().count(name) >= 1


def test_library_reports_instead_of_raising(artifact_copy, tiny_checkpoint, plant):
    plant.patch(artifact_copy, "lm_head.scales", lambda s: -s)
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=False)
    assert report.passed is False
    assert any(line.startswith("finite: lm_head.scales") and "zero or negative" in line for line in report.failures)
    assert {c.name: c.passed for c in report.checks}["finite"] is False


def test_unresolvable_source_is_a_usage_error(artifact_copy, capsys):
    # the tiny source is recorded by folder name only, which is not a folder from here
    rc = main(["validate", str(artifact_copy), "--no-e2e"])
    assert rc == 2
    assert "--source" in capsys.readouterr().err


def test_missing_artifact_is_a_usage_error(tmp_path, capsys):
    rc = main(["validate", str(tmp_path / "nope")])
    assert rc == 2
    assert "no such artifact folder" in capsys.readouterr().err


def test_end_to_end_measures_only_the_replaced_weights(tiny_checkpoint):
    """Null check: replacing the converted modules with the source's own weights changes nothing."""
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.validate.transformers_forward import run_end_to_end

    src = Checkpoint.open(tiny_checkpoint)
    modules = [m for m, parts in src.modules.items() if "weight" in parts and parts["weight"].klass in
               ("shared_expert", "lm_head")]
    assert len(modules) == 13
    r = run_end_to_end(tiny_checkpoint, tiny_checkpoint, modules, max_tokens=64)
    assert "error" not in r, r
    assert r["modules_replaced"] == 13
    assert r["kl"] == 0.0 and r["top1_agreement"] == 1.0 and r["ppl_change"] == 0.0


def test_compressed_tensors_build_passes_and_repack_is_checked(tiny_checkpoint, test_recipe, tmp_path, plant, capsys):
    from hybrid_build.pipeline.build import prepare
    from hybrid_build.pipeline.runner import run_build

    out = tmp_path / "ct"
    ctx = prepare(tiny_checkpoint, out, str(test_recipe))
    ctx.recipe.output.format = "compressed-tensors"
    from hybrid_build.recipes.conversion import plan_conversion

    ctx.plan = plan_conversion(ctx.source, ctx.recipe)
    run_build(ctx, stages=[s for s in STAGES if s != "validate"])
    rc, rep = _validate(out, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 0, rep["failures"]
    assert rep["format"] == "compressed-tensors"
    module = "model.language_model.layers.0.linear_attn.out_proj"
    plant.patch(out, module + ".weight_packed", lambda t: t ^ 1)  # flip one bit of every word
    rc, rep = _validate(out, tiny_checkpoint, capsys, "--no-e2e")
    assert rc == 1
    assert any(f.startswith(f"tensors: {module}: repacked INT4 tensors") for f in rep["failures"]), rep["failures"]
