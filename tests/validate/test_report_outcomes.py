"""A validation report says exactly what ran: passed, failed and could not run are three outcomes
(exit 0, 1, 3); a run that checked less never replaces a passing report of the same build that
checked more, and a run that does not pass never replaces it at all (it is recorded beside it).
vLLM is not installed here, so `--engine vllm` is the real could-not-run case."""
from __future__ import annotations

import importlib.util
import json

import pytest

from hybrid_build.core.artifact import REPORTS, VALIDATION_LAST, validation_outcome
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.modelcard import _what_validation_ran

VALIDATION = REPORTS["validation"]


def _validate(capsys, art, *extra):
    code = main(["validate", str(art), "-q", *extra])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def common(tiny_checkpoint, test_recipe) -> list[str]:
    return ["--source", str(tiny_checkpoint), "--recipe", str(test_recipe)]


@pytest.fixture
def validated(artifact_copy, common, capsys):
    """The copy, validated in full (the end-to-end forward included)."""
    code, err = _validate(capsys, artifact_copy, *common)
    assert code == 0, err
    return artifact_copy


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the engine would run")
def test_an_engine_that_cannot_run_is_not_a_failure_and_keeps_the_report(validated, common, capsys):
    before = (validated / VALIDATION.main).read_bytes()
    code, err = _validate(capsys, validated, *common, "--engine", "vllm")
    assert code == 3
    assert len(err) == 1 and err[0].startswith("validation could not run: end_to_end:") and "vLLM" in err[0]
    assert (validated / VALIDATION.main).read_bytes() == before


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the engine would run")
def test_could_not_run_on_a_fresh_build_writes_that_outcome(artifact_copy, common, capsys):
    assert main(["validate", str(artifact_copy), *common, "--engine", "vllm", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["outcome"] == "could not run" and data["passed"] is False and data["failures"] == []
    states = {c["name"]: c["state"] for c in data["checks"]}
    assert states["end_to_end"] == "could not run" and "fail" not in states.values()
    written = json.loads((artifact_copy / VALIDATION.main).read_text())
    assert written["outcome"] == "could not run"
    assert "could not run" in _what_validation_ran(written) and "a teacher-forced" not in _what_validation_ran(written)


def test_a_weaker_passing_run_keeps_the_stronger_report(validated, common, capsys):
    before = (validated / VALIDATION.main).read_bytes()
    assert main(["validate", str(validated), *common, "--no-e2e"]) == 0
    out = capsys.readouterr().out
    assert "kept:" in out and "end_to_end" in out
    assert (validated / VALIDATION.main).read_bytes() == before
    assert "a teacher-forced end-to-end comparison" in _what_validation_ran(json.loads(before))


def test_a_run_that_fails_is_recorded_beside_the_passing_report_never_over_it(validated, common, plant, capsys):
    name = next(n for n in json.loads((validated / "hybrid_build" / "provenance.json").read_text())["files"]
                if n.endswith(".safetensors"))
    with open(validated / name, "r+b") as f:  # one byte of a shard: sha256 no longer matches
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    kept = {rel: (validated / rel).read_bytes() for rel in VALIDATION.files + REPORTS["reference"].files}
    code, err = _validate(capsys, validated, *common, "--no-e2e")
    assert code == 1 and err[0].startswith("validation FAILED") and VALIDATION_LAST.named(".md") in err[1]
    assert {rel: (validated / rel).read_bytes() for rel in kept} == kept  # the build's report and reference
    failed = json.loads((validated / VALIDATION_LAST.main).read_text())
    assert failed["outcome"] == "failed" and failed["finished_at"]
    assert any(name in line for line in failed["failures"] if line.startswith("provenance: "))
    assert "no end-to-end comparison with the source model (it was skipped)" in _what_validation_ran(failed)
    outcome = validation_outcome(validated)
    assert (outcome.state, outcome.report) == ("failed", VALIDATION_LAST.main) and name in outcome.reason
