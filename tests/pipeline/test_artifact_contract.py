"""One artifact contract (``core.artifact``): a report written after the build never makes validate
or publish fail and is never recorded as a build output; a file that is neither still fails.

Every step runs through the real command line on a real build of the tiny checkpoint; eval runs
lm-eval's hf backend on two examples of one bundled task (about 15 s on a CPU)."""
from __future__ import annotations

import json
import shutil

import pytest

from hybrid_build.core.artifact import (
    PROVENANCE,
    REPORTS,
    is_build_output,
    is_report,
    read_provenance,
    unexpected_files,
)
from hybrid_build.core.safetensors_io import TMP_SUFFIX
from hybrid_build.pipeline.cli import main

REPO = "my-org/tiny-hybrid"


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory, builder):
    """A built artifact (no validation yet) of the tiny checkpoint; read-only: copy it."""
    out = tmp_path_factory.mktemp("contract") / "out"
    builder(tiny_checkpoint, out)
    return out


@pytest.fixture
def artifact(built, tmp_path):
    """A private copy, work folder included (its manifests and source location stay valid)."""
    dst = tmp_path / "out"
    shutil.copytree(built, dst)
    return dst


def _recorded(artifact) -> set[str]:
    return set(json.loads((artifact / PROVENANCE).read_text())["files"])


def test_the_registry_says_what_each_file_is():
    assert {r.kind for r in REPORTS.values()} >= {"validation", "eval", "bench"}
    for rel in ("hybrid_build/eval.json", "hybrid_build/validation.png", "hybrid_build/bench.json"):
        assert is_report(rel) and not is_build_output(rel)
    for rel in (PROVENANCE, ".hybrid-build/calibrate.json", "model.safetensors" + TMP_SUFFIX):
        assert not is_build_output(rel)
    for rel in ("hybrid_build/recipe.yaml", "config.json", "notes.txt", "hybrid_build/other.json"):
        assert is_build_output(rel) and not is_report(rel)


def test_eval_then_validate_then_publish_dry_run(artifact, capsys):
    assert main(["eval", str(artifact), "--tasks", "hb_arith", "--limit", "2", "-q"]) == 0
    eval_json = REPORTS["eval"].path(artifact)
    assert json.loads(eval_json.read_text())["tasks"][0]["n"] == 2
    capsys.readouterr()
    # the bug: validate said "hybrid_build/eval.json is not listed in provenance.json" and wrote FAILED
    assert main(["validate", str(artifact), "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True, report["failures"]
    assert json.loads(REPORTS["validation"].path(artifact).read_text())["passed"] is True
    assert main(["publish", str(artifact), "--repo-id", REPO, "--dry-run", "--json", "-q"]) == 0
    plan = json.loads(capsys.readouterr().out)
    paths = {f["path"] for f in plan["files"]}
    assert set(REPORTS["eval"].files) <= paths and REPORTS["validation"].main in paths
    assert plan["validation"] == "passed"
    assert "Per-example results" in plan["card"]  # the eval report was made for this build: on the card


def test_an_unknown_file_still_fails_validate_and_publish(artifact, capsys):
    (artifact / "notes.txt").write_text("added after the build\n")
    (artifact / "hybrid_build" / "extra.json").write_text("{}\n")
    assert unexpected_files(artifact, read_provenance(artifact)) == \
        ["hybrid_build/extra.json", "notes.txt"]
    assert main(["validate", str(artifact), "--json", "-q"]) == 1
    failures = json.loads(capsys.readouterr().out)["failures"]
    assert "provenance: notes.txt is not listed in hybrid_build/provenance.json" in failures
    assert "provenance: hybrid_build/extra.json is not listed in hybrid_build/provenance.json" in failures
    assert main(["publish", str(artifact), "--repo-id", REPO, "--dry-run", "--force", "-q"]) == 1
    assert "hybrid_build/extra.json is not listed in hybrid_build/provenance.json" in capsys.readouterr().err


def test_a_report_is_never_recorded_by_a_rebuild(artifact, tiny_checkpoint, capsys):
    before = _recorded(artifact)
    for report in REPORTS.values():  # every known report, as its command would leave it
        for rel in report.files:
            (artifact / rel).write_text("{}\n")
    assert main(["run", str(tiny_checkpoint), "-o", str(artifact), "--recipe", "tiny", "--from", "assemble",
                 "--no-validate", "-q"]) == 0
    after = _recorded(artifact)
    assert after == before and not any(is_report(rel) for rel in after)
    for report in REPORTS.values():
        report.path(artifact).unlink()  # placeholders, not reports: validate writes its own next
    assert main(["validate", str(artifact), "-q"]) == 0


def test_validate_refuses_a_folder_that_is_not_a_build(tmp_path, tiny_checkpoint, capsys):
    folder = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, folder)
    assert main(["validate", str(folder), "--source", str(tiny_checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no hybrid_build/provenance.json" in err
    assert not (folder / "hybrid_build").exists()  # no report written into it


def test_a_new_stage_that_writes_into_the_artifact_needs_only_its_module(tiny_checkpoint, tmp_path, monkeypatch):
    """A sixth stage (here: a checksum list beside the weights) is its module, its place in the
    order and a name in ``record``'s reads: its file is recorded in the provenance and validate
    and publish accept it, with no edit to either."""
    import dataclasses
    import sys
    import types

    from hybrid_build.pipeline import build, runner, stages
    from hybrid_build.pipeline.stages import record
    from hybrid_build.pipeline.stages.base import Stage
    from hybrid_build.validate.report import validate_artifact

    def run(ctx, io):
        path = ctx.out / "hybrid_build" / "sums.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(f"{f} {i['sha256']}\n" for f, i in sorted(io.up["assemble"].details["files"].items())))
        return [path], {}

    module = types.ModuleType("hybrid_build_test_sums")
    module.STAGE = Stage("sums", run, reads=("assemble",))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(stages.STAGE_MODULES, "sums", module.__name__)
    monkeypatch.setattr(record, "STAGE", dataclasses.replace(record.STAGE, reads=("assemble", "sums")))
    order = ["inspect", "calibrate", "quantize-head", "assemble", "sums", "record"]
    out = tmp_path / "out"
    ran = runner.run_build(build.prepare(tiny_checkpoint, out, "tiny"), order)
    assert [r.stage for r in ran] == order
    assert "hybrid_build/sums.txt" in _recorded(out)
    report = validate_artifact(out, e2e=False)
    assert report.passed, report.failures
    assert main(["publish", str(out), "--repo-id", REPO, "--dry-run", "-q"]) == 0


def test_run_leaves_the_model_card_in_the_folder(tiny_checkpoint, tmp_path, capsys):
    """The card `publish` uploads as README.md is in the folder after `run`, names only the checks
    that ran, is a known report (validate passes beside it) and is not uploaded a second time."""
    from hybrid_build.pipeline.publish import plan_publish

    out = tmp_path / "out"
    assert main(["run", str(tiny_checkpoint), "-o", str(out), "--json", "-q"]) == 0
    card = REPORTS["card"].path(out)
    assert json.loads(capsys.readouterr().out)["card"] == str(card)
    text = card.read_text()
    assert text.startswith("---\n") and "## Validation" in text and "Validation passed" in text
    assert "a teacher-forced end-to-end comparison with the source model" in text
    assert is_report(REPORTS["card"].main) and not is_build_output(REPORTS["card"].main)
    assert main(["validate", str(out), "--no-e2e", "-q"]) == 0
    paths = [f.path for f in plan_publish(out, REPO).files]
    assert "README.md" in paths and REPORTS["card"].main not in paths
