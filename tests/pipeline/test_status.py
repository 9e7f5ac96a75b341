"""``hybrid-build status OUT``: each stage's state from the output folder alone, keyed by content.

Builds of the tiny checkpoint by the real runner: a complete one, a half one (``--only inspect
calibrate``), one whose source then changes, and one whose output loses a shard."""
from __future__ import annotations

import json
import shutil

import pytest

from hybrid_build.core.artifact import REPORTS, seal_reports
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.stages import STAGES
from hybrid_build.pipeline.status import output_status


def status_json(out, capsys) -> dict:
    capsys.readouterr()
    rc = main(["status", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == (1 if data["artifact"] and not data["artifact"]["intact"] else 0)  # 1: files not as bound
    return data


def states(data: dict) -> dict[str, str]:
    return {s["stage"]: s["state"] for s in data["stages"]}


def reasons(data: dict) -> dict[str, str]:
    return {s["stage"]: s["reason"] for s in data["stages"]}


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory, builder):
    out = tmp_path_factory.mktemp("status") / "out"
    builder(tiny_checkpoint, out)
    return out


def test_a_fresh_build_is_done_from_any_directory(built, build_stages, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no source, no recipe argument: the folder says where they are
    data = status_json(built, capsys)
    assert data["built"] and data["recipe"] == "tiny" and len(data["provenance_sha256"]) == 64
    assert data["source"]["state"] == "unchanged"
    assert states(data) == {s: "done" if s in build_stages else "missing" for s in STAGES}
    assert {r["report"]: r["state"] for r in data["reports"]} == {k: "missing" for k in REPORTS}
    assert data["unexpected"] == []
    assert main(["status", str(built)]) == 0
    text = capsys.readouterr().out
    assert "calibrate      done" in text and "validate       missing" in text


def test_reports_belong_to_the_build_by_its_provenance_hash(built, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built, out)
    eval_json = REPORTS["eval"].path(out)
    prov = json.loads((out / "hybrid_build" / "provenance.json").read_text())
    sha = output_status(out).provenance_sha256
    eval_json.write_text(json.dumps({"tasks": [], "artifact": {"provenance_sha256": sha}}))
    REPORTS["bench"].path(out).write_text(json.dumps({"results": []}))
    (out / "notes.txt").write_text("added later")
    seal_reports(out)  # as `eval` and `bench --out` do once their report is written
    reports = {r.report: r for r in output_status(out).reports}
    assert reports["eval"].state == "current" and reports["eval"].files == ["hybrid_build/eval.json"]
    assert reports["bench"].state == "unknown"  # bench names no build
    assert output_status(out).unexpected == ["notes.txt"]
    prov["format_note"] = "another build"  # a rebuild: another provenance, the same old report
    (out / "hybrid_build" / "provenance.json").write_text(json.dumps(prov))
    again = {r.report: r for r in output_status(out).reports}
    assert again["eval"].state == "stale" and "earlier build" in again["eval"].reason


def test_a_half_built_output(tiny_checkpoint, tmp_path, builder, capsys):
    out = tmp_path / "half"
    builder(tiny_checkpoint, out, stages=["inspect", "calibrate"])  # as if interrupted after calibrate
    data = status_json(out, capsys)
    assert not data["built"] and data["provenance_sha256"] is None
    assert data["source"]["state"] == "unchanged"  # recorded with the first manifest, not at assemble
    got = states(data)
    assert got["inspect"] == got["calibrate"] == "done"
    assert {got[s] for s in STAGES if s not in ("inspect", "calibrate")} == {"missing"}


def test_a_removed_output_makes_its_stage_stale(built, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(built, out)
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    data = status_json(out, capsys)
    assert states(data)["assemble"] == "stale" and reasons(data)["assemble"] == f"{shard.name} is missing"
    assert states(data)["calibrate"] == "done"


def test_a_changed_source_makes_every_stage_stale_and_a_gone_one_unknown(tiny_copy, tmp_path, builder, capsys):
    out = tmp_path / "out"
    builder(tiny_copy, out)
    assert set(states(status_json(out, capsys)).values()) <= {"done", "missing"}
    with open(tiny_copy / "tokenizer_config.json", "a") as f:
        f.write("\n")  # one byte more: the build read other bytes
    data = status_json(out, capsys)
    assert data["source"]["state"] == "changed" and "tokenizer_config.json" in data["source"]["reason"]
    for stage in ("inspect", "calibrate", "quantize-head", "assemble"):
        assert states(data)[stage] == "stale" and reasons(data)[stage].startswith("the source changed")
    shutil.move(tiny_copy, tmp_path / "moved")
    data = status_json(out, capsys)
    assert data["source"]["state"] == "unreachable"
    assert states(data)["assemble"] == "unknown" and "cannot be recomputed" in reasons(data)["assemble"]


def test_a_changed_recipe_section_is_named(built, tmp_path, tiny_checkpoint, capsys):
    from hybrid_build.recipes.schema import load_recipe

    out = tmp_path / "out"
    shutil.copytree(built, out)
    recipe = load_recipe("tiny")
    recipe.lm_head.chunk_rows = recipe.lm_head.chunk_rows // 2 + 1  # the lm_head section: quantize-head reads it
    path = tmp_path / "edited.yaml"
    path.write_text(recipe.to_yaml())
    # an interrupted run with the edited recipe: it got as far as inspect
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--recipe", str(path), "--only", "inspect", "-q"]) == 0
    data = status_json(out, capsys)
    assert states(data)["inspect"] == states(data)["calibrate"] == "done"
    assert states(data)["quantize-head"] == "stale"
    assert reasons(data)["quantize-head"] == "its recipe section differs from the recorded recipe"


@pytest.mark.parametrize("make", ["missing", "empty", "file"])
def test_not_an_output_is_one_line_and_exit_2(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make == "empty":
        target.mkdir()
    elif make == "file":
        target.write_text("x")
    assert main(["status", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err
