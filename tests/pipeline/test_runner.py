"""`hybrid-build run` through the runner and its stages on the tiny checkpoint: what the output
holds, its numerics, both formats loading back, recipe errors, resume after an interruption, and
the background head alongside assemble."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil

import pytest
import torch

from hybrid_build.calibration.metrics import error_metrics
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import UserError
from hybrid_build.core.tensor_classes import split_module
from hybrid_build.core.weights import load_weight, read_tensor
from hybrid_build.pipeline import build, runner
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.stages import assemble as asm
from hybrid_build.pipeline.stages import base as stage_base
from hybrid_build.pipeline.stages import quantize_head


def _bytes(ckpt, t):
    with open(ckpt.path_of(t), "rb") as f:
        f.seek(t.start)
        return hashlib.sha256(f.read(t.nbytes)).hexdigest()


def test_every_source_tensor_is_kept_or_converted_as_declared(tiny_checkpoint, inc_artifact):
    src, out = Checkpoint.read_folder(tiny_checkpoint), Checkpoint.read_folder(inc_artifact)
    prov = json.loads((inc_artifact / "hybrid_build" / "provenance.json").read_text())
    converted = {c["module"]: c for c in prov["converted"]}
    expected_new = set()
    for name, t in src.tensors.items():
        module, part = split_module(name)
        if module in converted and part == "weight":
            assert name not in out.tensors or out.tensors[name].dtype != t.dtype
            expected_new.update(converted[module]["tensors"])
            continue
        assert name in out.tensors, f"{name} lost"
        assert _bytes(out, out.tensors[name]) == _bytes(src, t), f"{name} changed"
    fp8 = [m for m, c in converted.items() if c["kind"] == "fp8"]
    assert len(fp8) == 3 * src.text_config["num_hidden_layers"]
    for m in fp8:
        assert out.tensors[m + ".weight"].dtype == "F8_E4M3"
        n, k = out.tensors[m + ".weight"].shape
        assert out.tensors[m + ".weight_scale_inv"].shape == (math.ceil(n / 128), math.ceil(k / 128))
        assert out.tensors[m + ".weight_scale_inv"].dtype == "F32"
    assert out.tensors["lm_head.qweight"].dtype == "I32" and out.tensors["lm_head.scales"].dtype == "F16"
    # nothing else appears
    kept = {n for n in src.tensors if not (split_module(n)[0] in converted and split_module(n)[1] == "weight")}
    assert set(out.tensors) == kept | expected_new
    # MTP tensors survive and are now listed in the index
    index = json.loads((inc_artifact / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(index.get(n) == "model_extra_tensors.safetensors" for n in out.tensors if n.startswith("mtp."))
    assert set(index) == set(out.tensors)
    # the other files arrive intact
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (inc_artifact / f).read_bytes() == (tiny_checkpoint / f).read_bytes()
    cfg = json.loads((inc_artifact / "config.json").read_text())
    extra = cfg["quantization_config"]["extra_config"]
    assert all(extra[m]["data_type"] == "fp" and extra[m]["bits"] == 8 for m in fp8)
    assert extra["lm_head"]["bits"] == 8
    assert cfg["hybrid_build"]["format"] == "inc-hybrid" and sorted(cfg["hybrid_build"]["fp8_modules"]) == sorted(fp8)
    assert (inc_artifact / "hybrid_build" / "recipe.yaml").exists()


def test_provenance_hashes_every_file(inc_artifact):
    prov = json.loads((inc_artifact / "hybrid_build" / "provenance.json").read_text())
    files = {str(p.relative_to(inc_artifact)) for p in inc_artifact.rglob("*")
             if p.is_file() and not p.relative_to(inc_artifact).parts[0].startswith(".")}
    assert set(prov["files"]) == files - {"hybrid_build/provenance.json"}
    for rel, info in prov["files"].items():
        assert hashlib.sha256((inc_artifact / rel).read_bytes()).hexdigest() == info["sha256"], rel


def test_fp8_and_int8_errors_sit_at_the_format_floor(tiny_checkpoint, inc_artifact):
    """The tiny model's weights are Gaussian (std 0.02). E4M3 keeps 3 mantissa bits: rounding to
    the nearest of 8 steps per binade gives ~2.6% relative RMS error on Gaussian data (measured
    0.026 on 1024x3072); block scales cost little on top. Symmetric int8 with a per-row absmax
    scale over K=256 Gaussian values (absmax ~2.8 sigma) has a step of 2.8/127 sigma and an RMS
    error of step/sqrt(12) ~ 0.64% relative."""
    src, out = Checkpoint.read_folder(tiny_checkpoint), Checkpoint.read_folder(inc_artifact)
    prov = json.loads((inc_artifact / "hybrid_build" / "provenance.json").read_text())
    for c in prov["converted"]:
        m = error_metrics(load_weight(src, c["module"]), load_weight(out, c["module"]))
        assert m["rel_error"] == pytest.approx(c["metrics"]["rel_error"], rel=1e-6)  # provenance is truthful
        if c["kind"] == "fp8":
            assert 0.018 < m["rel_error"] < 0.032, (c["module"], m)
            assert m["cosine"] > 0.9995
        else:
            assert 0.004 < m["rel_error"] < 0.009, (c["module"], m)
            assert m["cosine"] > 0.99995


def test_int4_weights_dequantize_identically(tiny_checkpoint, inc_artifact, ct_artifact):
    src = Checkpoint.read_folder(tiny_checkpoint)
    for art in (inc_artifact, ct_artifact):
        out = Checkpoint.read_folder(art)
        for module in ("model.language_model.layers.0.mlp.experts.3.down_proj",
                       "model.language_model.layers.3.self_attn.q_proj",
                       "model.language_model.layers.1.linear_attn.in_proj_qkv"):
            assert torch.equal(load_weight(src, module), load_weight(out, module)), (art.name, module)


def test_compressed_tensors_int4_repack_is_bit_exact(tiny_checkpoint, ct_artifact, inc_artifact):
    src, out = Checkpoint.read_folder(tiny_checkpoint), Checkpoint.read_folder(ct_artifact)
    m = "model.language_model.layers.2.mlp.experts.5.gate_proj"
    assert torch.equal(read_tensor(out, m + ".weight_packed"), read_tensor(src, m + ".qweight").t())
    assert torch.equal(read_tensor(out, m + ".weight_scale"), read_tensor(src, m + ".scales").t())
    assert read_tensor(out, m + ".weight_shape").tolist() == [128, 256]
    assert m + ".qzeros" not in out.tensors
    cfg = json.loads((ct_artifact / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and set(cfg["config_groups"]) == {"int4", "fp8", "int8_head"}
    assert out.tensors["lm_head.weight_packed"].shape == (1024, 256 // 4)
    assert out.tensors["lm_head.weight_scale"].shape == (1024, 1)
    assert cfg["config_groups"]["int8_head"]["format"] == "pack-quantized"
    assert cfg["config_groups"]["int8_head"]["weights"]["num_bits"] == 8
    # same codes as the GPTQ head of the inc-hybrid build, only transposed
    inc = Checkpoint.read_folder(inc_artifact)
    assert torch.equal(read_tensor(out, "lm_head.weight_packed"), read_tensor(inc, "lm_head.qweight").t())


@pytest.mark.slow
def test_compressed_tensors_artifact_loads_in_transformers(tiny_checkpoint, ct_artifact, tmp_path):
    """transformers' compressed-tensors loader reads the artifact (dequantize mode, CPU). Two
    limits of transformers 5.17 are worked around, and named: its fused in-memory MoE experts
    cannot be targeted by compressed-tensors, so the experts are filled from the artifact's
    ``weight_packed`` tensors through our unpacker (bit-exact with the source, tested above); and
    its FP8 scheme fake-quantizes activations, which is turned off to compare weights alone."""
    import subprocess
    import sys

    script = tmp_path / "forward.py"
    script.write_text(FORWARD_SCRIPT)
    outs = {}
    for tag, path, extra in (("ct", ct_artifact, []), ("src", tiny_checkpoint, []),
                             ("ref", tiny_checkpoint, [str(ct_artifact)])):
        dest = tmp_path / f"{tag}.pt"
        r = subprocess.run([sys.executable, str(script), tag, str(path), str(dest), *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[tag] = torch.load(dest)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # transformers' reading of our tensors == our own dequantizer's (bf16 scales cost ~0.3%)
    assert rel(outs["ct"], outs["ref"]) < 0.03
    # and the hybrid stays close to the source model
    assert rel(outs["ct"], outs["src"]) < 0.1
    assert (outs["ct"].argmax(-1) == outs["src"].argmax(-1)).float().mean() >= 0.75


FORWARD_SCRIPT = r'''
import sys, torch, transformers
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.weights import load_weight
tag, path, dest = sys.argv[1:4]
ids = torch.tensor([[5, 17, 99, 300, 12, 7, 800, 44, 3, 9, 10, 11, 40, 41, 42, 43]])
kw = {"quantization_config": transformers.CompressedTensorsConfig(run_compressed=False)} if tag == "ct" else {}
m = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16, **kw)
mods = dict(m.named_modules())
if tag == "ct":
    c = Checkpoint.read_folder(path)
    for i, layer in enumerate(m.model.language_model.layers):
        ex = layer.mlp.experts
        for j in range(ex.gate_up_proj.shape[0]):
            p = f"model.language_model.layers.{i}.mlp.experts.{j}."
            g, u, d = (load_weight(c, p + n) for n in ("gate_proj", "up_proj", "down_proj"))
            ex.gate_up_proj.data[j] = torch.cat([g, u], 0).to(torch.bfloat16)
            ex.down_proj.data[j] = d.to(torch.bfloat16)
    for mod in mods.values():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None:
            scheme.input_activations = None
if tag == "ref":
    art = Checkpoint.read_folder(sys.argv[4])
    for name in art.hybrid_info["fp8_modules"] + ["lm_head"]:
        mods[name].weight.data = load_weight(art, name).to(torch.bfloat16)
with torch.no_grad():
    torch.save(m(input_ids=ids).logits.float(), dest)
'''


def test_recipe_typo_exits_2_naming_the_field(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: typo\nshared_experts:\n  obsrver: mse\n")
    code = main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "--recipe", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "shared_experts.obsrver" in err and "observer" in err
    assert len(err.strip().splitlines()) == 1
    bad.write_text("name: typo\nlm_head:\n  storage: int3\n")
    assert main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "--recipe", str(bad)]) == 2
    assert "lm_head.storage" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_into_a_foreign_folder_is_refused(tiny_checkpoint, tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a hybrid-build output"):
        build.prepare(tiny_checkpoint, tmp_path, "tiny")


def _all_files(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and not p.relative_to(root).parts[0].startswith(".")}


def test_interrupted_run_resumes_to_the_same_bytes(tiny_checkpoint, inc_artifact, tmp_path, monkeypatch, builder,
                                                   build_stages):
    out = tmp_path / "out"
    calls = {"n": 0}
    original = asm.write_shard

    def dying(plan, out_dir, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed while writing the second shard
        return original(plan, out_dir, **kw)

    monkeypatch.setattr(asm, "write_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        builder(tiny_checkpoint, out)
    assert not (out / "model.safetensors.index.json").exists()  # does not look complete
    monkeypatch.setattr(asm, "write_shard", original)
    ctx = build.prepare(tiny_checkpoint, out, "tiny")
    results = runner.run_build(ctx, build_stages)
    status = {r.stage: r.status for r in results}
    assert status["calibrate"] == status["quantize-head"] == "skipped" and status["assemble"] == "ran"
    assert _all_files(out) == _all_files(inc_artifact)
    # a third run does nothing
    again = runner.run_build(build.prepare(tiny_checkpoint, out, "tiny"), build_stages)
    assert {r.status for r in again} == {"skipped"}


def test_changed_recipe_reruns_the_stages_it_affects(tiny_checkpoint, tmp_path, builder, build_stages):
    out = tmp_path / "out"
    builder(tiny_checkpoint, out)
    ctx = build.prepare(tiny_checkpoint, out, "tiny")
    ctx.recipe.shared_experts.observer = "mse"
    status = {r.stage: r.status for r in runner.run_build(ctx, build_stages)}
    assert status == {"inspect": "skipped", "calibrate": "ran", "quantize-head": "skipped", "assemble": "ran",
                      "record": "ran"}


def test_damaged_intermediate_is_recomputed(tiny_checkpoint, tmp_path, builder, build_stages):
    out = tmp_path / "out"
    builder(tiny_checkpoint, out)
    fp8 = out / ".hybrid-build" / "calibrate" / "shared_experts_fp8.safetensors"
    fp8.write_bytes(fp8.read_bytes()[:-10])
    ctx = build.prepare(tiny_checkpoint, out, "tiny")
    status = {r.stage: r.status for r in runner.run_build(ctx, build_stages)}
    assert status["calibrate"] == "ran"


def test_dry_run_writes_nothing(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not out.exists()
    assert data["recipe"] == "tiny" and data["stages"]["calibrate"] == "would run"
    assert len(data["conversion"]["conversions"]) == 13
    assert data["output_bytes_estimate"] < data["source_bytes"]


def test_unknown_stage_is_a_usage_error(tiny_checkpoint, tmp_path, capsys):
    assert main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "o"), "--only", "calibrat"]) == 2
    assert "unknown stage 'calibrat'" in capsys.readouterr().err


def test_assemble_alone_needs_current_upstream_results(tiny_checkpoint, tmp_path, capsys):
    assert main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "o"), "--only", "assemble"]) == 2
    assert "needs a current calibrate result" in capsys.readouterr().err


def test_already_hybrid_source_is_refused(inc_artifact, tmp_path, capsys):
    assert main(["run", str(inc_artifact), "-o", str(tmp_path / "o")]) == 2
    assert "already a hybrid" in capsys.readouterr().err


def test_copy_of_artifact_is_still_readable(inc_artifact, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(inc_artifact, dst)
    assert not Checkpoint.read_folder(dst).errors()


def test_head_is_quantized_while_assemble_writes_other_shards(tiny_checkpoint, inc_artifact, tmp_path, monkeypatch,
                                                             build_stages):
    """quantize-head runs in the background: a shard without the head is complete before the
    head is computed, the shard holding the head waits for it, and the result is the sequential
    build's. Ordered by events, not by sleeping: the head stage may only start once assemble has
    finished a shard without the head, which it can only do if it does not wait for the head."""
    import threading

    other_shard_written = threading.Event()
    head_started = threading.Event()
    finished_before_head: list[str] = []
    original_head, original_write = quantize_head.STAGE.run, asm.write_shard

    def gated_head(ctx, io):
        # generous: on a loaded 2-core machine a shard of the tiny model takes well under a second
        if not other_shard_written.wait(timeout=120):
            raise AssertionError("no shard without the head was written while the head waited: "
                                 "assemble does not run alongside quantize-head")
        head_started.set()  # from here on the head may be handed over
        return original_head(ctx, io)

    def write(plan, out_dir, **kw):
        path = original_write(plan, out_dir, **kw)
        if not head_started.is_set():
            finished_before_head.append(plan.filename)
        if not any(t.name.startswith("lm_head.") for t in plan.tensors):
            other_shard_written.set()
        return path

    taken: dict[str, bool] = {}
    original_take = stage_base.Handover.take

    def take(self, name):
        t = original_take(self, name)
        taken[name] = t is not None
        return t

    monkeypatch.setattr(quantize_head, "STAGE", dataclasses.replace(quantize_head.STAGE, run=gated_head))
    monkeypatch.setattr(asm, "write_shard", write)
    monkeypatch.setattr(stage_base.Handover, "take", take)
    out = tmp_path / "out"
    ctx = build.prepare(tiny_checkpoint, out, "tiny")
    results = runner.run_build(ctx, build_stages)
    assert [r.stage for r in results] == build_stages and {r.status for r in results} == {"ran"}
    assert head_started.is_set()
    assert finished_before_head  # written while the head was waiting to be quantized
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    head_shard = index["lm_head.qweight"]
    assert head_shard not in finished_before_head
    # the head's tensors are the last ones of their shard
    from hybrid_build.core.safetensors_io import read_header

    in_shard = [t.name for t in sorted(read_header(out / head_shard).tensors.values(), key=lambda t: t.start)]
    assert len(in_shard) > 3 and set(in_shard[-3:]) == {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales"}
    # handed over in memory, not read back from the head file
    assert taken == {"lm_head.qweight": True, "lm_head.qzeros": True, "lm_head.scales": True}
    assert _all_files(out) == _all_files(inc_artifact)


def test_failed_background_head_fails_the_build_and_leaves_it_incomplete(tiny_checkpoint, inc_artifact, tmp_path,
                                                                        monkeypatch, build_stages):
    def broken_head(ctx, io):
        raise RuntimeError("head exploded")

    monkeypatch.setattr(quantize_head, "STAGE", dataclasses.replace(quantize_head.STAGE, run=broken_head))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="head exploded"):
        runner.run_build(build.prepare(tiny_checkpoint, out, "tiny"), build_stages)
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / ".hybrid-build" / "quantize-head.json").exists()
    monkeypatch.undo()
    results = runner.run_build(build.prepare(tiny_checkpoint, out, "tiny"), build_stages)
    assert {r.stage: r.status for r in results}["quantize-head"] == "ran"
    assert _all_files(out) == _all_files(inc_artifact)


def _stat_of_checkpoint(out):
    """(inode, mtime_ns) of every file the checkpoint is made of: a rewrite changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(out.iterdir())
            if p.is_file() and (p.suffix == ".safetensors"
                                or p.name in ("config.json", "model.safetensors.index.json"))}


@pytest.mark.parametrize("edit", ["validate", "serve"])
def test_a_recipe_edit_outside_the_checkpoint_rewrites_no_shard(tiny_checkpoint, tmp_path, builder, build_stages, edit):
    """Each stage's key covers the recipe sections it reads: a validate threshold or a serve setting
    changes the recipe copy and the provenance (``record``) and what reads
    them (``validate``), never the checkpoint's files."""
    from hybrid_build.core.artifact import PROVENANCE, RECIPE

    out = tmp_path / "out"
    builder(tiny_checkpoint, out)
    before, prov_before = _stat_of_checkpoint(out), (out / PROVENANCE).read_text()
    ctx = build.prepare(tiny_checkpoint, out, "tiny")
    if edit == "validate":
        ctx.recipe.validate_.fp8_max_rel_error = 0.05
    else:
        ctx.recipe.serve.smoke_expect = "Lyon"
    status = {r.stage: r.status for r in runner.run_build(ctx, build_stages)}
    assert status == {"inspect": "skipped", "calibrate": "skipped", "quantize-head": "skipped",
                      "assemble": "skipped", "record": "ran"}
    assert _stat_of_checkpoint(out) == before
    assert (out / PROVENANCE).read_text() != prov_before
    assert ctx.recipe.to_yaml() == (out / RECIPE).read_text()
    fresh = build.prepare(tiny_checkpoint, out, "tiny")
    assert runner.stage_key(ctx, "validate") != runner.stage_key(fresh, "validate")


class _RecordingBar:
    def __init__(self, **kw) -> None:
        self.desc, self.total, self.n, self.closed = kw.get("desc", ""), kw.get("total"), 0, False

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_each_head_bar_is_drawn_once_and_finishes(tiny_checkpoint, tmp_path, build_stages):
    """Planning the background head's layout draws no bar; the bar of the run reaches its total."""
    bars: list[_RecordingBar] = []

    def factory(**kw):
        bars.append(_RecordingBar(**kw))
        return bars[-1]

    ctx = build.prepare(tiny_checkpoint, tmp_path / "out", "tiny", progress=factory)
    runner.run_build(ctx, build_stages)
    head = [b for b in bars if b.desc.startswith("quantize ")]
    assert [b.desc for b in head] == [f"quantize {c.module}" for c in ctx.plan.of_kind("int8")]
    assert all(b.n == b.total and b.total > 0 for b in head)


def test_vv_says_why_each_stage_runs_or_is_skipped(tiny_checkpoint, tmp_path, capsys):
    """-vv adds hybrid-build's own debug lines: per stage, its key or why it has to run."""
    from hybrid_build.pipeline.cli import main

    out = tmp_path / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--no-validate", "-q"]) == 0
    capsys.readouterr()
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--no-validate", "-vv"]) == 0
    assert "DEBUG hybrid_build.pipeline.runner: assemble: current (key " in capsys.readouterr().err
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--no-validate", "--from", "record", "-vv"]) == 0
    err = capsys.readouterr().err
    assert "DEBUG hybrid_build.pipeline.runner: record: forced" in err
    assert "DEBUG hybrid_build.pipeline.runner: record: manifest saved (key " in err
