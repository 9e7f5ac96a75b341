"""The end-to-end check through ``validate``: the streamed forward by default, its statistics in the
report, a planted defect that it catches on its own, the user's texts, and the lm-head check on
the forward's real hidden states."""
from __future__ import annotations

import json

import pytest
import torch

from hybrid_build.pipeline.cli import main
from hybrid_build.validate.report import validate_artifact

SE = "model.language_model.layers.{}.mlp.shared_expert.{}_proj"


def test_planted_fp8_scale_moves_the_end_to_end_kl_and_fails_it(artifact_copy, built_artifact, tiny_checkpoint,
                                                                 plant):
    clean = validate_artifact(built_artifact, tiny_checkpoint, e2e=True, write=False).end_to_end
    module = SE.format(1, "down")
    plant.patch(artifact_copy, module + ".weight_scale_inv",
                lambda s: s.index_put_((torch.tensor(1), torch.tensor(0)), s[1, 0] * 4))
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, write=False)
    e2e = report.end_to_end
    # one block of 128x128 weights four times too large in one layer: the whole model's next-token
    # distributions move well outside the clean build's interval, and the check fails by itself
    assert e2e["kl"] > 5 * clean["kl"] and e2e["kl_ci95"][0] > clean["kl_ci95"][1]
    assert not next(c for c in report.checks if c.name == "end_to_end").passed
    assert any(f.startswith("end_to_end:") for f in report.failures)


def test_lm_head_is_checked_on_the_forwards_real_hidden_states(artifact_copy, tiny_checkpoint):
    report = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, write=False)
    head = report.lm_head
    assert head["inputs"].startswith("real (final-norm hidden states")
    assert head["tokens"] == report.end_to_end["tokens"] + len(report.end_to_end["texts"])  # every position
    without = validate_artifact(artifact_copy, tiny_checkpoint, e2e=False, write=False).lm_head
    assert without["inputs"].startswith("random")


def test_users_texts_and_the_estimate_printed_first(artifact_copy, tiny_checkpoint, tmp_path, capsys):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps({"name": n, "text": t}) for n, t in
                               [("greeting", "Hello there, how are you doing today? " * 8),
                                ("numbers", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 4)]) + "\n")
    txt = tmp_path / "story.txt"
    txt.write_text("Once upon a time a small model learned to count its own bytes. " * 6)
    rc = main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--texts", str(jsonl),
               "--texts", str(txt), "--json"])
    captured = capsys.readouterr()
    e2e = json.loads(captured.out)["end_to_end"]
    assert rc in (0, 1) and set(e2e["texts"]) == {"greeting", "numbers", "story"}
    assert sum(t["tokens"] for t in e2e["texts"].values()) == e2e["tokens"]
    assert "end-to-end forward (streamed" not in captured.err  # --json keeps stderr quiet
    main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--texts", str(txt)])
    err = capsys.readouterr().err
    assert "end-to-end forward (streamed, 4 layers" in err and "INT4 matrices at" in err


def test_bad_texts_are_one_line(artifact_copy, tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "a", "text": "fine"}\n{"text": "no name"}\n')
    report = artifact_copy / "hybrid_build" / "validation.json"
    before = report.read_bytes() if report.exists() else None
    assert main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--texts", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f'error: {bad}:2: expected a JSON object with "name" and "text"'
    assert (report.read_bytes() if report.exists() else None) == before
    # a text that tokenizes to fewer than 2 tokens: one sentence in the report, not a traceback
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"name": "blank", "text": ""}) + "\n")
    rep = validate_artifact(artifact_copy, tiny_checkpoint, e2e=True, texts=[short], write=False)
    assert "'blank'" in rep.end_to_end["error"] and "at least 2" in rep.end_to_end["error"]


def test_unknown_engine_is_a_usage_error(artifact_copy, tiny_checkpoint):
    from hybrid_build.core.errors import UserError

    with pytest.raises(UserError, match="unknown end-to-end engine"):
        validate_artifact(artifact_copy, tiny_checkpoint, engine="nonsense", write=False)
