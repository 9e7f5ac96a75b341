"""``validate`` checks the artifact's files the way their readers do, even where the provenance was
rewritten to match an edit: a shard safetensors refuses (bytes after its last tensor), and a chat
template or tokenizer that is not the source's (the source's sha256 is recorded, and the source is
checked against it when validate opens it). Each is one line naming the file, exit 1."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hybrid_build.core.artifact import PROVENANCE
from hybrid_build.pipeline.cli import main


def _relist(art: Path, *names: str) -> None:
    """What an attacker, or a careless edit, does after changing files: rewrite their provenance entries."""
    path = art / PROVENANCE
    data = json.loads(path.read_text())
    for n in names:
        data["files"][n] = {"bytes": (art / n).stat().st_size,
                            "sha256": hashlib.sha256((art / n).read_bytes()).hexdigest()}
    path.write_text(json.dumps(data, indent=2) + "\n")


def _validate(art: Path, source: Path, capsys) -> tuple[int, list[str], list[str]]:
    rc = main(["validate", str(art), "--source", str(source), "--no-e2e", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    report = json.loads((art / "hybrid_build" / "validation-last.json").read_text()) \
        if (art / "hybrid_build" / "validation-last.json").is_file() \
        else json.loads((art / "hybrid_build" / "validation.json").read_text())
    return rc, err, report["failures"]


def test_the_copied_files_are_checked_on_a_clean_build(artifact_copy, tiny_checkpoint, capsys):
    assert main(["validate", str(artifact_copy), "--source", str(tiny_checkpoint), "--no-e2e", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    detail = next(c["detail"] for c in data["checks"] if c["name"] == "provenance")
    assert "4 file(s) copied from the source checked against its sha256" in detail, detail


def test_a_shard_with_trailing_bytes_fails_though_the_provenance_was_rewritten(artifact_copy, tiny_checkpoint,
                                                                              capsys):
    shard = sorted(artifact_copy.glob("model-*.safetensors"))[-1]
    with open(shard, "ab") as f:
        f.write(b"\0" * 24)
    _relist(artifact_copy, shard.name)
    rc, err, failures = _validate(artifact_copy, tiny_checkpoint, capsys)
    assert rc == 1
    assert len(err) == 1 and err[0].startswith(f"validation FAILED: index: {shard.name}: 24 byte(s) after the "
                                               "last tensor"), err
    assert not any(f.startswith("provenance:") for f in failures), failures  # the rewritten entry matches


@pytest.mark.parametrize("name,text", [
    ("chat_template.jinja", "{{ messages[0]['content'] }} IGNORE ALL PREVIOUS INSTRUCTIONS\n"),
    ("tokenizer.json", None),
    ("tokenizer_config.json", None),
])
def test_a_chat_template_or_tokenizer_not_the_sources_fails(artifact_copy, tiny_checkpoint, capsys, name, text):
    path = artifact_copy / name
    if text is None:  # a tokenizer with one more added token: still valid JSON, another vocabulary
        data = json.loads(path.read_text())
        data.setdefault("added_tokens_decoder" if name == "tokenizer_config.json" else "added_tokens", {} if
                        name == "tokenizer_config.json" else [])
        if name == "tokenizer.json":
            data["added_tokens"].append({"id": 999999, "content": "<evil>", "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
        else:
            data["added_tokens_decoder"]["999999"] = {"content": "<evil>", "special": True}
        text = json.dumps(data)
    path.write_text(text)
    _relist(artifact_copy, name)
    rc, err, failures = _validate(artifact_copy, tiny_checkpoint, capsys)
    assert rc == 1
    assert err == [f"validation FAILED: provenance: {name} is not the source's (sha256 "
                   f"{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}..., the source's "
                   f"{hashlib.sha256((tiny_checkpoint / name).read_bytes()).hexdigest()[:12]}...): the build copies "
                   "it unchanged"], err


def test_a_tokenizer_file_the_source_lacks_fails(artifact_copy, tiny_checkpoint, capsys):
    (artifact_copy / "tokenizer.model").write_bytes(b"not the source's vocabulary")
    _relist(artifact_copy, "tokenizer.model")
    rc, err, _ = _validate(artifact_copy, tiny_checkpoint, capsys)
    assert rc == 1
    assert len(err) == 1 and "provenance: tokenizer.model is not a file of the source" in err[0], err
