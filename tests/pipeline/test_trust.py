"""What an artifact says about its source is true: content fingerprints, where the source is,
overrides applied before planning, recipes that do not fit, and filesystem failures.

Each test here failed on the tool before sources were identified by content (see the issue
"Trust the artifact")."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_build.core import source_identity
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.pipeline import build, runner
from hybrid_build.pipeline.build import RecipeOverrides
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.stages import STAGES
from hybrid_build.recipes.schema import load_recipe, select_recipe

SHARED = "model.language_model.layers.1.mlp.shared_expert.up_proj.weight"


def _rewrite_tensor(folder: Path, name: str, change) -> None:
    """Rewrite the safetensors file holding ``name`` with ``change(tensor)`` in its place (same
    dtype and shape unless ``change`` says otherwise), through the safetensors library."""
    ckpt = Checkpoint.read_folder(folder)
    path = ckpt.path_of(ckpt.tensors[name])
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path), metadata=meta)


def _statuses(results) -> dict[str, str]:
    return {r.stage: r.status for r in results}


# ------------------------------------------------------------------ 1. identity by content


def test_same_shape_source_with_other_weights_rebuilds(tiny_checkpoint, tmp_path, builder, build_stages):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    shutil.copytree(tiny_checkpoint, a)
    shutil.copytree(tiny_checkpoint, b)
    _rewrite_tensor(b, SHARED, lambda t: t * 2)  # same header, other bytes
    builder(a, out)
    old_fp8 = (out / ".hybrid-build" / "calibrate" / "shared_experts_fp8.safetensors").read_bytes()

    results = runner.run_build(build.prepare(b, out, "tiny"), build_stages)
    assert set(_statuses(results).values()) == {"ran"}
    prov = json.loads((out / "hybrid_build" / "provenance.json").read_text())
    digests = source_identity.SourceDigests(b).result()
    assert prov["source"]["files"] == digests  # the per-file sha256 of what was read
    assert prov["source"]["fingerprint"] == source_identity.fingerprint_of(digests)
    # the output holds B's calibration, not A's: its block scales follow the doubled weights
    # (absmax / 448 scales exactly with the weights; x2 is exact in BF16 and float32)
    old = tmp_path / "old_fp8.safetensors"
    old.write_bytes(old_fp8)
    scale = SHARED + "_scale_inv"
    with safe_open(old, "pt") as fa, safe_open(_file_of(out, scale), "pt") as fb:
        assert torch.equal(fb.get_tensor(scale), 2 * fa.get_tensor(scale))


def _file_of(folder: Path, name: str) -> Path:
    ckpt = Checkpoint.read_folder(folder)
    return ckpt.path_of(ckpt.tensors[name])


def test_resumed_run_reads_digests_from_the_cache(tiny_checkpoint, tmp_path, builder, build_stages, monkeypatch):
    out = tmp_path / "out"
    builder(tiny_checkpoint, out)

    def no_hashing(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(source_identity, "sha256_file", no_hashing)
    results = runner.run_build(build.prepare(tiny_checkpoint, out, "tiny"), build_stages)
    assert set(_statuses(results).values()) == {"skipped"}


def test_rewritten_file_is_hashed_again(tiny_copy, tmp_path):
    cache = tmp_path / "cache.json"
    first = source_identity.SourceDigests(tiny_copy, cache).result()
    _rewrite_tensor(tiny_copy, SHARED, lambda t: t + 1)
    second = source_identity.SourceDigests(tiny_copy, cache).result()
    changed = [f for f in first if first[f] != second[f]]
    assert changed == [_file_of(tiny_copy, SHARED).name]


# ------------------------------------------------------------------ 2. where the source is


@pytest.fixture
def built_elsewhere(tiny_checkpoint, tmp_path, builder):
    """An artifact built from a private copy of the tiny checkpoint named ``src``, then validated."""
    src, out = tmp_path / "build" / "src", tmp_path / "build" / "out"
    shutil.copytree(tiny_checkpoint, src)
    builder(src, out)
    assert main(["validate", str(out), "--no-e2e", "-q"]) == 0
    return src, out


def test_validate_and_serve_work_from_any_directory(built_elsewhere, tmp_path, monkeypatch, capsys):
    src, out = built_elsewhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["validate", str(out), "--no-e2e", "-q"]) == 0
    capsys.readouterr()
    assert main(["serve", str(out), "--profile", "base", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == str(src.resolve())  # absolute, from wherever it is asked


def test_same_named_foreign_folder_is_refused_and_the_report_kept(built_elsewhere, tmp_path, monkeypatch, capsys):
    src, out = built_elsewhere
    report = out / "hybrid_build" / "validation.json"
    before = report.read_bytes()
    impostor = tmp_path / "cwd" / "src"
    shutil.copytree(src, impostor)
    _rewrite_tensor(impostor, SHARED, lambda t: -t)
    monkeypatch.chdir(impostor.parent)
    # given explicitly: refused by content
    assert main(["validate", str(out), "--source", "src", "--no-e2e"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not the source this artifact was built from" in err[0]
    # the recorded source moved away: the same-named folder here is not taken for it
    src.rename(src.with_name("moved"))
    assert main(["validate", str(out), "--no-e2e"]) == 2
    assert "pass --source" in capsys.readouterr().err
    assert main(["serve", str(out), "--profile", "base", "--dry-run", "--source", "src"]) == 2
    assert report.read_bytes() == before  # a passing report is never overwritten by a wrong source


def test_demo_source_is_printed_as_an_absolute_path(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """The demo keeps its source inside the artifact; serve names it by absolute path."""
    out = tmp_path / "demo-out"
    shutil.copytree(tiny_checkpoint, out / ".hybrid-build" / "demo-source")
    ctx = build.prepare(out / ".hybrid-build" / "demo-source", out, "tiny", in_artifact=".hybrid-build/demo-source")
    runner.run_build(ctx, [s for s in STAGES if s != "validate"])
    moved = tmp_path / "moved-demo-out"
    out.rename(moved)  # the whole artifact moves: its demo source moves with it
    monkeypatch.chdir(tmp_path)
    # built without validate: serve refuses it (docs/serve.md) unless --force, which still plans it
    assert main(["serve", "moved-demo-out", "--profile", "base", "--dry-run", "--json"]) == 1
    assert "validation missing" in capsys.readouterr().err
    assert main(["serve", "moved-demo-out", "--profile", "base", "--dry-run", "--json", "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str((moved / ".hybrid-build" / "demo-source").resolve())


# ------------------------------------------------------------------ 3. overrides before planning


@pytest.fixture
def odd_head(tiny_copy):
    """The tiny checkpoint with 2 lm-head rows fewer: GPTQ int8 cannot pack it (rows % 4 != 0)."""
    _rewrite_tensor(tiny_copy, "lm_head.weight", lambda t: t[:-2].clone())
    return tiny_copy


def test_format_override_applies_before_planning(odd_head, tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(odd_head), "-o", str(out), "--recipe", "tiny", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--format compressed-tensors" in err and "lm_head.storage: bf16" in err
    assert main(["run", str(odd_head), "-o", str(out), "--recipe", "tiny", "--format", "compressed-tensors",
                 "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "compressed-tensors"
    rows, cols = Checkpoint.read_folder(tiny_checkpoint).tensors["lm_head.weight"].shape
    assert [c["shape"] for c in data["conversion"]["conversions"] if c["kind"] == "int8"] == [[rows - 2, cols]]


def test_overrides_do_not_leak_into_the_shipped_recipe(tiny_checkpoint, tmp_path):
    ctx = build.prepare(tiny_checkpoint, tmp_path / "o", "tiny", overrides=RecipeOverrides(observer="mse"))
    assert ctx.recipe.shared_experts.observer == "mse"
    assert load_recipe("tiny").shared_experts.observer == "minmax"


# ------------------------------------------------------------------ 4. recipes that do not fit


def test_recipe_that_does_not_fit_is_refused_unless_forced(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", "qwen3.5-122b-a10b", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size is 256, the recipe is for 3072" in err and "num_hidden_layers is 4" in err
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", "qwen3.5-122b-a10b", "--force",
                 "--dry-run", "--json"]) == 0
    assert "forced" in json.loads(capsys.readouterr().out)["recipe_choice"]


def test_a_family_member_without_a_recipe_gets_targets_from_its_structure(tiny_checkpoint):
    ckpt = Checkpoint.read_folder(tiny_checkpoint)
    other_size = {**ckpt.text_config, "hidden_size": 2304, "num_hidden_layers": 28}
    assert select_recipe(other_size, ckpt.model_type).name == "qwen3.5-moe"
    assert select_recipe(ckpt.text_config, ckpt.model_type).name == "tiny"  # its own recipe still wins
    from hybrid_build.recipes.conversion import plan_conversion

    family = plan_conversion(ckpt, load_recipe("qwen3.5-moe"))
    shared = {m for m in ckpt.modules if m.startswith(ckpt.lm_prefix + "layers.") and ".mlp.shared_expert." in m}
    assert {c.module for c in family.of_kind("fp8")} == shared and len(shared) == 3 * 4  # decoder layers, not MTP
    assert [c.module for c in family.of_kind("int8")] == ["lm_head"]


# ------------------------------------------------------------------ 5. filesystem failures


def _mount_tmpfs(path: Path, size: str, readonly: bool = False) -> None:
    path.mkdir(parents=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(size: str, readonly: bool = False) -> Path:
        p = tmp_path / f"fs{len(mounted)}"
        _mount_tmpfs(p, size, readonly)
        mounted.append(p)
        return p

    yield make
    for p in mounted:
        subprocess.run(["umount", str(p)], check=False)


def test_small_disk_is_refused_before_writing(tiny_checkpoint, tmpfs, capsys):
    fs = tmpfs("3m")
    out = fs / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", "tiny"]) == 2  # another folder fixes it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "free on its filesystem" in err[0] and "MB" in err[0]
    assert not out.exists()  # refused before anything is written: not even the output folder


def test_disk_full_mid_write_is_one_line_and_nothing_looks_complete(tiny_checkpoint, tmpfs, monkeypatch, capsys):
    fs = tmpfs("4m")
    out = fs / "out"
    real = shutil.disk_usage
    monkeypatch.setattr(runner.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))  # defeat the check
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", "tiny", "--json"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and str(fs) in err[0]
    result = json.loads(captured.out)
    assert result["status"] == "failed" and result["failed_stage"] in ("calibrate", "quantize-head", "assemble")
    assert not (out / "model.safetensors.index.json").exists()
    complete = [p for p in out.glob("*.safetensors")]
    for p in complete:  # a shard under its final name was renamed only once whole
        with safe_open(p, "pt") as f:
            assert list(f.keys())


def test_read_only_output_is_one_line(tiny_checkpoint, tmpfs, capsys):
    fs = tmpfs("1m", readonly=True)
    assert main(["run", str(tiny_checkpoint), "-o", str(fs / "out"), "--recipe", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Read-only file system" in err[0] and str(fs / "out") in err[0]


def test_unreadable_source_file_is_one_line(tiny_copy, tmp_path, monkeypatch, capsys):
    victim = _file_of(tiny_copy, SHARED)
    real_open = open

    def refusing_open(file, *a, **kw):  # root reads any file: refuse at the real open call instead
        if Path(file) == victim and "w" not in (a[0] if a else kw.get("mode", "r")):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr("builtins.open", refusing_open)
    assert main(["run", str(tiny_copy), "-o", str(tmp_path / "out"), "--recipe", "tiny", "--no-validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {victim}: Permission denied"]


# ------------------------------------------------------------------ 6./7. results a script relies on


def test_json_result_on_validation_failure(tiny_checkpoint, tmp_path, capsys):
    recipe = load_recipe("tiny").model_copy(deep=True)
    recipe.validate_.fp8_max_rel_error = 1e-6  # no FP8 tensor can meet this
    recipe.validate_.e2e = False
    path = tmp_path / "strict.yaml"
    path.write_text(recipe.to_yaml())
    out = tmp_path / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", str(path), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "failed" and result["failed_stage"] == "validate"
    assert Path(result["report"]) == out / "hybrid_build" / "validation.md" and Path(result["report"]).exists()
    assert [s["stage"] for s in result["stages"]][-1] == "validate"


def test_from_redoes_the_stage_and_those_after_it(tiny_checkpoint, tmp_path, builder, capsys):
    out = tmp_path / "out"
    builder(tiny_checkpoint, out)
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--from", "assemble", "--no-validate", "--json"]) == 0
    status = {s["stage"]: s["status"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert status == {"assemble": "ran", "record": "ran"}


def test_run_names_how_the_recipe_was_chosen(tiny_checkpoint, tmp_path, capsys):
    assert main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "o"), "--dry-run"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("recipe tiny (chosen from the source's config.json)") and "(given)" not in first
