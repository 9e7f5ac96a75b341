"""The reference (``validate.reference``): written by a streamed validate run next to its report,
shaped as the format says, consistent with the report's perplexities and with an independent
forward, tied to its build, and absent when the run did not compute it."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from hybrid_build.core.artifact import PROVENANCE, REPORTS, report_state, seal_report_at
from hybrid_build.core.errors import ArtifactError, UserError
from hybrid_build.validate.reference import SIDES, K, read_reference
from hybrid_build.validate.report import validate_artifact

REFERENCE = REPORTS["reference"]


@pytest.fixture(scope="module")
def validated(built_artifact, tiny_checkpoint, tmp_path_factory):
    """A copy of the built artifact after one streamed validate run: (folder, report)."""
    art = tmp_path_factory.mktemp("reference") / "hybrid"
    shutil.copytree(built_artifact, art, ignore=shutil.ignore_patterns(".hybrid-build"))
    report = validate_artifact(art, tiny_checkpoint)
    assert report.passed, report.failures
    return art, report


@pytest.fixture
def validated_copy(validated, tmp_path):
    dst = tmp_path / "hybrid"
    shutil.copytree(validated[0], dst)
    return dst


def test_validate_writes_a_current_reference(validated):
    art, report = validated
    for f in REFERENCE.files:
        assert (art / f).is_file()
        assert str(art / f) in report.written
    assert report_state(art, REFERENCE)[0] == "current"
    data = json.loads(REFERENCE.path(art).read_text())
    assert data["schema_version"] == 1 and data["k"] == K == 20
    assert data["engine"] == "streamed" and data["dtype"] == "float32" and data["what"]
    assert data["positions"] == report.end_to_end["tokens"]
    assert set(data["texts"]) == set(report.end_to_end["texts"])


def test_the_reference_has_the_mode_of_every_other_file(validated):
    """Every file validate and the build wrote has the mode the umask gives (the reference was
    written 0600 by safetensors' writer while the others were 0644)."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    art, _ = validated
    modes = {str(p.relative_to(art)): stat.S_IMODE(p.stat().st_mode) for p in art.rglob("*") if p.is_file()}
    assert any(f.endswith("reference.safetensors") for f in modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_shapes_dtypes_and_probabilities(validated):
    art, report = validated
    ref = read_reference(art)
    assert ref.k == 20 and ref.provenance_sha256 == report.provenance_sha256
    assert ref.positions == report.end_to_end["tokens"]
    for text in ref.texts.values():
        rows = len(text.token_ids) - 1
        assert rows == report.end_to_end["texts"][text.name]["tokens"]
        for side in SIDES:
            ids, lp, tgt = text.top_ids[side], text.top_logprobs[side], text.target_logprob[side]
            assert ids.dtype == torch.int32 and ids.shape == (rows, 20)
            assert lp.dtype == torch.float32 and lp.shape == (rows, 20)
            assert tgt.dtype == torch.float32 and tgt.shape == (rows,)
            assert bool((lp[:, :-1] >= lp[:, 1:]).all()), "top-k log-probs must be descending"
            assert bool((torch.logsumexp(lp.double(), 1) <= 1e-6).all()), "top-k mass above 1"
            assert bool((tgt <= 1e-6).all())
            assert all(len(set(row)) == 20 for row in ids.tolist())
            # the observed token, when it is in the top-k, carries the same log-prob there
            hit = ids == torch.tensor(text.token_ids[1:], dtype=torch.int32)[:, None]
            assert torch.allclose(lp[hit], tgt[hit.any(1)], atol=1e-6)
        # the tiny model is random: the sides differ, a little
        assert not torch.equal(text.top_logprobs["hybrid"], text.top_logprobs["source"])


@pytest.mark.parametrize("side,figure", [("hybrid", "ppl_hybrid"), ("source", "ppl_source")])
def test_target_logprobs_give_the_reports_perplexity(validated, side, figure):
    # divergence.summarize: ppl = exp(mean over scored positions of -log p(observed next token))
    art, report = validated
    e2e = report.end_to_end
    ref = read_reference(art)
    per_text = {n: t.target_logprob[side].double() for n, t in ref.texts.items()}
    for name, lp in per_text.items():
        assert math.exp(-float(lp.mean())) == pytest.approx(e2e["texts"][name][figure], rel=1e-5)
    assert math.exp(-float(torch.cat(list(per_text.values())).mean())) == pytest.approx(e2e[figure], rel=1e-5)


def test_hybrid_side_matches_an_independent_forward(validated, tiny_checkpoint):
    # streamed_logits runs the artifact alone, one text, whole logits: another path to the same numbers
    from hybrid_build.validate.streamed import streamed_logits

    art, _ = validated
    ref = read_reference(art)
    text = min(ref.texts.values(), key=lambda t: len(t.token_ids))
    for side, folder in (("hybrid", art), ("source", tiny_checkpoint)):
        logits = streamed_logits(folder, {text.name: text.token_ids}, device="cpu", vocab_chunk=256)[text.name]
        logprobs = torch.log_softmax(logits[:-1].double(), -1)
        top = logprobs.topk(K, dim=-1)
        assert torch.equal(text.top_ids[side][:, 0].long(), top.indices[:, 0])
        assert torch.allclose(text.top_logprobs[side].double(), top.values, atol=1e-4)
        observed = logprobs.gather(1, torch.tensor(text.token_ids[1:])[:, None])[:, 0]
        assert torch.allclose(text.target_logprob[side].double(), observed, atol=1e-4)


def test_no_e2e_writes_no_reference(artifact_copy, tiny_checkpoint):
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=False)
    assert report.kept is None and report.written
    assert not any((artifact_copy / f).exists() for f in REFERENCE.files)
    assert report_state(artifact_copy, REFERENCE)[0] == "missing"
    with pytest.raises(UserError, match="reference.json"):
        read_reference(artifact_copy)


def test_a_kept_report_keeps_its_reference(validated_copy, tiny_checkpoint, monkeypatch):
    from hybrid_build.validate import report as report_module

    for f in REFERENCE.files:
        (validated_copy / f).unlink()
    monkeypatch.setattr(report_module, "stronger_report", lambda artifact, report: "a stronger one stays")
    report = validate_artifact(validated_copy, tiny_checkpoint)
    assert report.kept and not report.written
    assert not any((validated_copy / f).exists() for f in REFERENCE.files)


def test_a_reference_of_another_build_is_stale(validated_copy):
    prov = validated_copy / PROVENANCE
    data = json.loads(prov.read_text())
    data["rebuilt"] = True  # another build of the folder: another provenance sha256
    prov.write_text(json.dumps(data))
    assert report_state(validated_copy, REFERENCE)[0] == "stale"
    with pytest.raises(ArtifactError, match="another build"):
        read_reference(validated_copy)


def test_files_that_do_not_belong_together_are_refused(validated_copy, validated):
    main = REFERENCE.path(validated_copy)
    data = json.loads(main.read_text())
    data["provenance_sha256"] = "0" * 64
    main.write_text(json.dumps(data))
    assert report_state(validated_copy, REFERENCE)[0] == "stale"
    with pytest.raises(ArtifactError, match="different builds"):
        read_reference(validated_copy)
    # the right JSON with a truncated text's tensors
    main.write_text(REFERENCE.path(validated[0]).read_text())
    data = json.loads(main.read_text())
    name = next(iter(data["texts"]))
    data["texts"][name]["token_ids"] = data["texts"][name]["token_ids"][:-1]
    main.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="do not belong together"):
        read_reference(validated_copy)
    (validated_copy / REFERENCE.named(".safetensors")).unlink()
    with pytest.raises(UserError, match="reference.safetensors"):
        read_reference(validated_copy)


def test_publish_sends_it_and_the_card_says_what_it_proves(validated_copy):
    from hybrid_build.pipeline.publish import plan_publish

    plan = plan_publish(validated_copy, "someone/tiny-hybrid")
    sent = {f.path for f in plan.files}
    assert set(REFERENCE.files) <= sent
    assert "hybrid-build verify URL" in plan.card_text and REFERENCE.named(".safetensors") in plan.card_text
    # one made for another build: the provenance and the validation report bind this one, so it is refused
    main = REFERENCE.path(validated_copy)
    main.write_text(json.dumps({**json.loads(main.read_text()), "provenance_sha256": "0" * 64}))
    with pytest.raises(ArtifactError, match="reference.json"):
        plan_publish(validated_copy, "someone/tiny-hybrid")
    seal_report_at(main)  # sealed as a command would seal it: the validation report still records the other one
    with pytest.raises(ArtifactError, match="reference.json is not the reference"):
        plan_publish(validated_copy, "someone/tiny-hybrid")
