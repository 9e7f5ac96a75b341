"""Publishing against a stand-in Hub (see hub_standin.py): dry run, gating on validation, upload,
resume after a failure without re-sending, retries, verification and token hygiene; plus one
opt-in live test."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

import pytest
from hub_standin import FAKE_TOKEN, StandInHub, http_error

from hybrid_build.core.artifact import seal_reports
from hybrid_build.core.byte_units import human_bytes
from hybrid_build.core.errors import ArtifactError, UserError
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.commands import publish as publish_command
from hybrid_build.pipeline.publish import Publisher, RetryPolicy, plan_publish, verify_remote

REPO = "my-org/tiny-hybrid"


def artifact_files(artifact: Path) -> dict[str, int]:
    """What is in the folder, by walking it (the work dir excluded): the expected upload. The folder's
    card (hybrid_build/card.md) goes up as README.md, not under its own name."""
    return {p.relative_to(artifact).as_posix(): p.stat().st_size for p in artifact.rglob("*")
            if p.is_file() and not p.relative_to(artifact).parts[0].startswith(".")
            and p.relative_to(artifact).as_posix() != "hybrid_build/card.md"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cli(monkeypatch, hub, no_sleep):
    """``hybrid-build`` with the stand-in as the Hub and a retry policy that does not sleep."""
    policy, _ = no_sleep
    monkeypatch.setattr(publish_command, "make_api", lambda: hub)
    monkeypatch.setattr(publish_command, "make_retry", lambda: policy)

    def run(*argv):
        return main(["publish", *map(str, argv)])
    return run


def error_lines(err: str) -> list[str]:
    """stderr without the progress line before the upload: what the user is told went wrong."""
    return [line for line in err.splitlines() if not line.startswith(("sending ", "all "))]


def publisher(plan, hub, policy, **kw) -> Publisher:
    return Publisher(plan, hub, retry=policy, **kw)


# ------------------------------------------------------------------------------------ dry run


def test_dry_run_lists_exactly_the_artifact_files_and_sends_nothing(validated_artifact, cli, hub, capsys):
    # the session artifact still has its .hybrid-build work dir: it must not be listed
    assert (validated_artifact / ".hybrid-build").is_dir()
    assert cli(validated_artifact, "--repo-id", REPO, "--dry-run") == 0
    out = capsys.readouterr().out
    listing, card = out.split("----- README.md -----\n")
    listed = {m.group(2): int(m.group(1).replace(",", ""))
              for m in re.finditer(r"^\s+([\d,]+)\s+(\S+)", listing, re.M)}
    card_bytes = listed.pop("README.md")
    assert listed == artifact_files(validated_artifact)
    expected_card = plan_publish(validated_artifact, REPO).card_text
    assert card.rstrip("\n") == expected_card.rstrip("\n") and card_bytes == len(expected_card.encode())
    total = int(re.search(r"^total ([\d,]+) bytes in (\d+) files", listing, re.M).group(1).replace(",", ""))
    assert total == sum(listed.values()) + card_bytes
    assert card.startswith("---\n") and "## Validation" in card
    assert hub.calls == [] and hub.sent == []


def test_dry_run_json(validated_artifact, cli, hub, capsys):
    assert cli(validated_artifact, "--repo-id", REPO, "--dry-run", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    files = {f["path"]: f["bytes"] for f in data["files"]}
    assert files.pop("README.md") == len(data["card"].encode())
    assert files == artifact_files(validated_artifact)
    assert data["total_bytes"] == sum(f["bytes"] for f in data["files"]) and hub.calls == []


# ------------------------------------------------------------------------------------ gating


def test_missing_validation_blocks_without_force(artifact, cli, hub, capsys):
    for name in ("validation.json", "validation.md", "validation.png"):
        (artifact / "hybrid_build" / name).unlink()
    assert cli(artifact, "--repo-id", REPO) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "validation.json does not exist" in err and "--force" in err
    assert hub.calls == []
    assert cli(artifact, "--repo-id", REPO, "--force") == 0
    assert "README.md" in hub.files(REPO)
    assert "published with `--force`" in hub.files(REPO)["README.md"].decode()


def test_failed_validation_blocks_without_force(artifact, cli, hub, capsys):
    vpath = artifact / "hybrid_build" / "validation.json"
    report = json.loads(vpath.read_text())
    report["passed"] = False
    report["failures"] = ["lm_head: top-1 agreement 0.91 < 0.97 (head_min_top1)"]
    vpath.write_text(json.dumps(report))
    seal_reports(artifact)  # as `validate` does once its report is written
    assert cli(artifact, "--repo-id", REPO, "--dry-run") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "validation FAILED" in err and "head_min_top1" in err
    assert hub.calls == []
    assert cli(artifact, "--repo-id", REPO, "--force", "--quiet") == 0
    assert "warning: published with --force (validation failed)" in capsys.readouterr().out


def test_report_of_another_build_counts_as_stale(artifact):
    prov = artifact / "hybrid_build" / "provenance.json"
    later = time.time() + 5
    os.utime(prov, (later, later))  # touched, same bytes: the same build (a copy need not keep mtimes)
    assert plan_publish(artifact, REPO).validation.state == "passed"
    data = json.loads(prov.read_text())
    prov.write_text(json.dumps({**data, "note": "rebuilt"}, indent=2) + "\n")  # another build
    with pytest.raises(UserError, match="made for an earlier build"):
        plan_publish(artifact, REPO)
    assert plan_publish(artifact, REPO, force=True).validation.state == "stale"


def test_a_report_naming_no_build_is_refused_unless_sealed_for_this_build(artifact):
    report = artifact / "hybrid_build" / "validation.json"
    data = json.loads(report.read_text())
    del data["provenance_sha256"]  # written before reports recorded their build
    report.write_text(json.dumps(data))
    later = time.time() + 5
    os.utime(artifact / "hybrid_build" / "provenance.json", (later, later))
    with pytest.raises(ArtifactError, match="validation.json has .* bytes"):  # edited: the seal says so
        plan_publish(artifact, REPO)
    seal_reports(artifact)  # as the command that wrote it does
    assert plan_publish(artifact, REPO).validation.state == "passed"
    prov = artifact / "hybrid_build" / "provenance.json"
    data = json.loads(prov.read_text())
    data.pop("reports")
    prov.write_text(json.dumps(data, indent=2) + "\n")  # a rebuild: `record` writes the provenance anew
    with pytest.raises(ArtifactError, match=r"reference.json is not recorded in .* \(and 4 more\)"):
        plan_publish(artifact, REPO)


def test_artifact_must_match_its_provenance(artifact):
    (artifact / "notes.txt").write_text("added later")
    with pytest.raises(ArtifactError, match="notes.txt is not listed in"):
        plan_publish(artifact, REPO)
    (artifact / "notes.txt").unlink()
    with open(artifact / "tokenizer.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(ArtifactError, match="tokenizer.json has .* bytes"):
        plan_publish(artifact, REPO)


def test_user_mistakes_exit_2(artifact, cli, tmp_path, capsys):
    assert cli(tmp_path / "nope", "--repo-id", REPO, "--dry-run") == 2
    assert cli(artifact, "--repo-id", "not a repo", "--dry-run") == 2
    assert cli(artifact, "--repo-id", REPO, "--revision", "refs/pr/3") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


# ------------------------------------------------------------------------------------ upload


def test_publish_uploads_everything_once_and_verifies(artifact, cli, hub, capsys):
    assert cli(artifact, "--repo-id", REPO, "--private") == 0  # a copy: publish keeps its card in the folder
    remote = hub.files(REPO)
    expected = artifact_files(artifact)
    for path in expected:
        if path == "README.md":
            continue
        assert remote[path] == (artifact / path).read_bytes(), path
    assert set(remote) == set(expected) | {"README.md", ".gitattributes"}
    assert not any(p.startswith(".hybrid-build") for p in remote)
    assert hub.repos[REPO].private
    # every file sent exactly once, the card last
    assert sorted(hub.sent_paths()) == sorted(set(expected) | {"README.md"})
    assert hub.sent_paths()[-1] == "README.md"
    out = capsys.readouterr().out
    assert f"{len(expected) + 1} files verified" in out
    assert ("list_repo_tree", {"repo_id": REPO, "recursive": True, "revision": "main"}) in hub.calls


def test_second_run_sends_nothing(artifact, hub, no_sleep):
    policy, _ = no_sleep
    plan = plan_publish(artifact, REPO)
    publisher(plan, hub, policy).run()
    hub.reset_records()
    told = []
    result = publisher(plan, hub, policy, on_send=lambda *a: told.append(a)).run()
    assert told == [([], len(plan.files))]
    assert hub.sent == [] and result.uploaded == [] and len(result.skipped) == len(plan.files)
    assert not any(name in ("upload_folder", "upload_file") for name, _ in hub.calls)


def test_interrupted_upload_resumes_without_resending(artifact, cli, hub, capsys):
    plan = plan_publish(artifact, REPO)
    # small batches, so the interruption falls between commits of several upload calls
    victim = "model-00003-of-00003.safetensors"
    assert victim in [f.path for f in plan.files]
    hub.fail_on_send[victim] = [ConnectionError("connection reset by peer")] * 10
    assert cli(artifact, "--repo-id", REPO) == 3  # the Hub did not answer: could not run
    err = capsys.readouterr().err
    assert err.startswith(f"sending {len(plan.files)} file(s)")  # the progress line before the upload
    assert len(error_lines(err)) == 1 and "run the same command again to resume" in err
    arrived = {p: d for p, d in hub.files(REPO).items() if p != ".gitattributes"}
    assert arrived and victim not in arrived and "README.md" not in arrived

    hub.fail_on_send.clear()
    hub.reset_records()
    assert cli(artifact, "--repo-id", REPO) == 0
    resent = set(hub.sent_paths())
    assert resent.isdisjoint(arrived), resent & set(arrived)
    assert resent == {f.path for f in plan.files} - set(arrived)
    assert sum(n for _, n in hub.sent) == plan.total_bytes - sum(len(d) for d in arrived.values())
    for f in plan.files:
        assert sha256(hub.files(REPO)[f.path]) == f.sha256, f.path


def test_transient_failure_mid_batch_is_retried_without_resending_what_arrived(artifact, hub, no_sleep):
    policy, waits = no_sleep
    plan = plan_publish(artifact, REPO)
    victim = "model-00002-of-00003.safetensors"
    hub.fail_on_send[victim] = [http_error(503, "service unavailable")]
    result = publisher(plan, hub, policy).run()
    counts = {p: hub.sent_paths().count(p) for p in set(hub.sent_paths())}
    # the victim went out twice (the failed attempt and the retry); everything else once
    assert counts.pop(victim) == 2 and set(counts.values()) == {1}
    assert waits == [policy.base_delay]
    assert sorted(result.uploaded) == sorted(f.path for f in plan.files)
    assert result.verified == len(plan.files)


def test_one_upload_folder_call_names_exactly_what_the_hub_lacks(artifact, hub, no_sleep):
    """What is on the Hub already is not handed to the library; the rest goes in one ``upload_folder``
    call naming each file (huggingface_hub batches its commits itself), the card after it."""
    policy, _ = no_sleep
    plan = plan_publish(artifact, REPO)
    hub.create_repo(REPO, exist_ok=True)
    there = ["model-00001-of-00003.safetensors", "config.json"]
    for path in there:
        hub.files(REPO)[path] = (artifact / path).read_bytes()
    hub.reset_records()
    result = publisher(plan, hub, policy).run()
    folder_calls = [kw for name, kw in hub.calls if name == "upload_folder"]
    assert len(folder_calls) == 1 and result.upload_calls == 2  # and one upload_file for the card
    named = sorted(folder_calls[0]["allow_patterns"])
    assert named == sorted(f.path for f in plan.files if f.path not in there and f.path != "README.md")
    assert folder_calls[0]["commit_message"] == f"hybrid-build publish {plan.artifact_id}: {artifact.name}"
    assert sorted(result.skipped) == sorted(there) and set(hub.sent_paths()).isdisjoint(there)


# ------------------------------------------------------------------------------------ retries and errors


def test_network_errors_are_retried_with_backoff_then_reported_in_one_line(artifact, cli, hub, no_sleep, capsys):
    policy, waits = no_sleep
    hub.fail_calls["create_repo"] = [ConnectionError("name resolution failed")] * policy.attempts
    assert cli(artifact, "--repo-id", REPO) == 3
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1
    assert f"did not answer after {policy.attempts} attempts" in err and "name resolution failed" in err
    # waits double from the base: base, 2 x base
    assert waits == [policy.base_delay * 2 ** i for i in range(policy.attempts - 1)]
    assert [name for name, _ in hub.calls] == ["create_repo"] * policy.attempts


def test_a_refusal_is_not_retried(artifact, cli, hub, capsys):
    hub.fail_calls["create_repo"] = [http_error(403, "forbidden")]
    assert cli(artifact, "--repo-id", REPO) == 2
    assert "HTTP 403" in capsys.readouterr().err
    assert [name for name, _ in hub.calls] == ["create_repo"]


def test_backoff_is_capped():
    p = RetryPolicy(attempts=10, base_delay=2, max_delay=30)
    assert [p.delay(i) for i in range(1, 7)] == [2, 4, 8, 16, 30, 30]


def test_token_never_appears_in_output_or_logs(artifact, cli, hub, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    # a server that echoes the request header back in its error message
    echo = ConnectionError(f"reset while sending 'Authorization: Bearer {FAKE_TOKEN}'")
    hub.fail_on_send["config.json"] = [echo] * 10
    assert cli(artifact, "--repo-id", REPO, "-vv") == 3
    hub.fail_on_send.clear()
    assert cli(artifact, "--repo-id", REPO, "-vv", "--json") == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err + caplog.text
    assert "Bearer ***" in text  # the message itself was shown...
    assert FAKE_TOKEN not in text  # ...without the token


def test_no_token_is_a_user_error(artifact, cli, monkeypatch, capsys):
    monkeypatch.setattr(publish_command, "make_api", lambda: StandInHub(token=None))
    assert cli(artifact, "--repo-id", REPO) == 2
    assert "HF_TOKEN" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ branches and PRs


def test_revision_creates_the_branch_and_leaves_main_alone(artifact, cli, hub):
    assert cli(artifact, "--repo-id", REPO, "--revision", "int8-head") == 0
    assert ("create_branch", {"repo_id": REPO, "branch": "int8-head", "exist_ok": True}) in hub.calls
    assert set(hub.files(REPO, "main")) == {".gitattributes"}
    assert "README.md" in hub.files(REPO, "int8-head")


def test_create_pr_resumes_into_the_same_pull_request(artifact, cli, hub, capsys):
    hub.fail_on_send["model-00003-of-00003.safetensors"] = [ConnectionError("reset")] * 10
    assert cli(artifact, "--repo-id", REPO, "--create-pr") == 3
    assert len(hub.repos[REPO].prs) == 1
    hub.fail_on_send.clear()
    capsys.readouterr()
    assert cli(artifact, "--repo-id", REPO, "--create-pr") == 0
    assert len(hub.repos[REPO].prs) == 1, "a second PR was opened"
    assert f"pull request: https://huggingface.co/{REPO}/discussions/1" in capsys.readouterr().out
    assert "README.md" in hub.files(REPO, "refs/pr/1")
    assert set(hub.files(REPO, "main")) == {".gitattributes"}


# ------------------------------------------------------------------------------------ verification


@pytest.fixture
def published(artifact, hub, no_sleep):
    policy, _ = no_sleep
    plan = plan_publish(artifact, REPO)
    publisher(plan, hub, policy).run()
    return plan


def test_verification_passes_on_a_faithful_remote(published, hub):
    verified, extra = verify_remote(hub, published)
    assert verified == len(published.files) and extra == []


@pytest.mark.parametrize("path,fields,says", [
    ("model-00001-of-00003.safetensors", {"size": 123}, "123 bytes on the Hub"),
    ("model-00002-of-00003.safetensors", {"sha256": "0" * 64}, "sha256 " + "0" * 64 + " on the Hub"),
    ("config.json", {"oid": "f" * 40}, "git blob " + "f" * 40 + " on the Hub"),
    ("README.md", {"oid": "e" * 40}, "git blob"),
])
def test_verification_names_a_remote_file_that_differs(published, hub, path, fields, says):
    hub.tamper(REPO, path, **fields)
    with pytest.raises(ArtifactError) as e:
        verify_remote(hub, published)
    assert str(e.value).startswith(f"remote verification failed: {path}: ") and says in str(e.value)


def test_a_local_change_after_the_plan_is_caught_before_its_part_is_sent(artifact, hub, no_sleep):
    # same size, different bytes, after the plan checked the files: each part is checked again
    policy, _ = no_sleep
    plan = plan_publish(artifact, REPO)
    shard = artifact / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"changed after it was checked: model-00003-of-00003.safetensors has "
                                            r"other bytes than hybrid_build/provenance.json"):
        publisher(plan, hub, policy).run()
    assert hub.sent == []


def test_verification_catches_a_local_change_after_the_upload(published, hub):
    # a file the Hub keeps in git is compared by blob id, after its local copy is checked against
    # the provenance: a local change made after the upload is named, not blamed on the Hub
    path = published.artifact / "tokenizer_config.json"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"tokenizer_config.json: the local file's sha256 differs from "
                                            r"hybrid_build/provenance.json"):
        verify_remote(hub, published)


def test_verification_catches_a_missing_file_and_notes_extra_ones(published, hub):
    del hub.files(REPO)["tokenizer.json"]
    with pytest.raises(ArtifactError, match="tokenizer.json: missing on the Hub"):
        verify_remote(hub, published)
    hub.files(REPO)["tokenizer.json"] = (published.artifact / "tokenizer.json").read_bytes()
    hub.files(REPO)["model-00009-of-00009.safetensors"] = b"stale"
    assert verify_remote(hub, published)[1] == ["model-00009-of-00009.safetensors"]


def test_verification_failure_exits_1_naming_the_file(artifact, cli, hub, capsys):
    assert cli(artifact, "--repo-id", REPO) == 0
    hub.tamper(REPO, "model_extra_tensors.safetensors", size=1)
    capsys.readouterr()
    assert cli(artifact, "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    # the remote shard looks wrong, so it is sent again; the Hub still reports 1 byte: an error
    size = human_bytes((artifact / "model_extra_tensors.safetensors").stat().st_size)
    others = len(plan_publish(artifact, REPO).files) - 1
    assert f"sending 1 file(s), {size}; {others} already on the Hub" in err
    assert len(error_lines(err)) == 1 and "model_extra_tensors.safetensors: 1 bytes on the Hub" in err


# ------------------------------------------------------------------------------------ live (opt-in)

# captured at import, before the autouse fixture isolates HF_HOME and removes HF_TOKEN
_LIVE = os.environ.get("HYBRID_BUILD_LIVE_HUB") == "1"
_LIVE_REPO = os.environ.get("HYBRID_BUILD_HUB_SCRATCH_REPO")
_LIVE_TOKEN = os.environ.get("HF_TOKEN")
if _LIVE and not _LIVE_TOKEN:
    from huggingface_hub import get_token

    _LIVE_TOKEN = get_token()


@pytest.mark.hub
@pytest.mark.skipif(not (_LIVE and _LIVE_REPO and _LIVE_TOKEN),
                    reason="live Hub test: set HYBRID_BUILD_LIVE_HUB=1, HYBRID_BUILD_HUB_SCRATCH_REPO=ORG/NAME "
                           "and HF_TOKEN (or log in)")
def test_live_publish_to_a_scratch_repo(artifact, monkeypatch):
    import huggingface_hub.constants as constants
    from huggingface_hub import HfApi

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = HfApi(token=_LIVE_TOKEN)
    branch = f"hybrid-build-test-{uuid.uuid4().hex[:8]}"
    plan = plan_publish(artifact, _LIVE_REPO)
    try:
        result = Publisher(plan, api, revision=branch, private=True).run()
        assert result.verified == len(plan.files)
        again = Publisher(plan, api, revision=branch).run()
        assert again.uploaded == [] and len(again.skipped) == len(plan.files)
    finally:
        api.delete_branch(_LIVE_REPO, branch=branch)
