"""The bound artifact (core.bound): one digest binds the build's files and its reports, nothing but
regular files leaves the folder, a build in progress is no artifact, and a signature (OpenSSF Model
Signing, with a key made here) says who signed and that every file matches. Each case runs the real
commands on a copy of the tiny checkpoint's validated artifact."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from signing_keys import keypair

from hybrid_build.core.artifact import IN_PROGRESS, PROVENANCE, REPORTS, seal_reports
from hybrid_build.core.bound import open_artifact
from hybrid_build.core.signing import SIGNATURE
from hybrid_build.pipeline.cli import main

REPO = "my-org/tiny-hybrid"
VALIDATION, REFERENCE = REPORTS["validation"], REPORTS["reference"]


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def refused_everywhere(capsys, art: Path, name: str) -> None:
    """serve --dry-run and publish --dry-run refuse in one line naming ``name``; status names it."""
    rc, _, err = cli(capsys, "serve", art, "--profile", "base", "--dry-run")
    assert rc == 1 and name in one_line(err), err
    rc, _, err = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run")
    assert rc == 1 and name in one_line(err), err
    rc, out, _ = cli(capsys, "status", art, "--json")
    data = json.loads(out)
    assert rc == 1 and not data["artifact"]["intact"] and name in data["artifact"]["problem"]
    rc, out, _ = cli(capsys, "verify-artifact", art)
    assert rc == 1 and name in out


# ------------------------------------------------------------------------------------ one digest


def test_an_edited_report_is_refused_naming_it(art, capsys):
    path = art / VALIDATION.main
    data = json.loads(path.read_text())
    data.update(passed=True, outcome="passed", failures=["lm_head: top-1 0.2 < 0.97"])
    path.write_text(json.dumps(data, indent=2))
    refused_everywhere(capsys, art, VALIDATION.main)


def test_a_shifted_reference_is_refused_naming_it(art, capsys):
    path = art / REFERENCE.named(".safetensors")
    tensors = load_file(str(path))
    save_file({k: (v.roll(1, 0).contiguous() if ".hybrid." in k else v) for k, v in tensors.items()}, str(path),
              metadata={"provenance_sha256": json.loads((art / REFERENCE.main).read_text())["provenance_sha256"]})
    refused_everywhere(capsys, art, REFERENCE.named(".safetensors"))


def test_a_reference_of_nans_is_refused_whole_even_when_sealed(art, capsys):
    """Even re-sealed, with the report's digests rewritten to match (what only a rewrite of the chain
    does), a reference of non-finite log-probabilities is refused, never half-used."""
    import hashlib

    path = art / REFERENCE.named(".safetensors")
    tensors = load_file(str(path))
    meta = {"provenance_sha256": json.loads((art / REFERENCE.main).read_text())["provenance_sha256"]}
    save_file({k: (v.clone().fill_(float("nan")) if "logprob" in k else v) for k, v in tensors.items()}, str(path),
              metadata=meta)
    report = json.loads((art / VALIDATION.main).read_text())
    report["reference_sha256"] = {p.rsplit("/", 1)[1]: hashlib.sha256((art / p).read_bytes()).hexdigest()
                                  for p in REFERENCE.files}
    (art / VALIDATION.main).write_text(json.dumps(report, indent=2))
    seal_reports(art)
    bound = open_artifact(art)
    assert len(bound.problems) == 1 and "not finite log-probabilities" in bound.problem and "refused whole" in \
        bound.problem
    refused_everywhere(capsys, art, REFERENCE.named(".safetensors"))
    from hybrid_build.validate.reference import read_reference

    with pytest.raises(Exception, match="refused whole"):
        read_reference(art)


def test_the_report_records_the_reference_it_rests_on(art):
    import hashlib

    recorded = json.loads((art / VALIDATION.main).read_text())["reference_sha256"]
    assert recorded == {p.rsplit("/", 1)[1]: hashlib.sha256((art / p).read_bytes()).hexdigest()
                        for p in REFERENCE.files}
    sealed = open_artifact(art).provenance.reports
    assert set(VALIDATION.files + REFERENCE.files) <= set(sealed)


# ------------------------------------------------------------------------------------ nothing leaves


def test_a_symlink_is_refused_and_never_listed(art, capsys, tmp_path):
    (art / ".env").write_text("HF_TOKEN=hf_notarealtoken\n")
    os.symlink("../.env", art / "hybrid_build" / "bench.json")
    refused_everywhere(capsys, art, "hybrid_build/bench.json is a symbolic link")
    (art / "hybrid_build" / "bench.json").unlink()
    os.symlink("/etc/passwd", art / "hybrid_build" / "eval.md")
    rc, _, err = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run")
    assert rc == 1 and "hybrid_build/eval.md is a symbolic link (to /etc/passwd)" in one_line(err)


def test_publish_lists_only_what_the_provenance_records(art, capsys):
    rc, out, _ = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--json")
    listed = {f["path"] for f in json.loads(out)["files"]}
    bound = open_artifact(art)
    assert listed == set(bound.shipped()) | {"README.md"}
    assert all((art / p).is_file() and not (art / p).is_symlink() for p in listed - {"README.md"})


# ------------------------------------------------------------------------------------ finished or not


def test_a_build_in_progress_is_no_artifact(art, capsys):
    (art / IN_PROGRESS).write_text(json.dumps({"pid": 2**22 + 12345}))  # no such process: it stopped
    rc, _, err = cli(capsys, "serve", art, "--profile", "base", "--dry-run")
    assert rc == 1 and "resume it with `hybrid-build run`" in one_line(err)
    rc, _, err = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run")
    assert rc == 1 and "resume it with `hybrid-build run`" in one_line(err)
    rc, out, _ = cli(capsys, "status", art)
    assert rc == 0 and "NOT FINISHED" in out.splitlines()[0]


def test_a_stopped_build_without_its_provenance_is_not_a_plain_checkpoint(art, capsys):
    (art / "model.safetensors.index.json").unlink()
    shutil.rmtree(art / "hybrid_build")
    rc, _, err = cli(capsys, "serve", art, "--profile", "base", "--dry-run")
    assert rc == 1 and "resume it with `hybrid-build run`" in one_line(err)


def test_a_second_run_into_a_locked_output_refuses_at_once_naming_the_holder(art, tiny_checkpoint):
    from hybrid_build.core.output_lock import hold_output

    with hold_output(art):
        child = subprocess.run([sys.executable, "-m", "hybrid_build.pipeline.cli", "run", str(tiny_checkpoint),
                                "-o", str(art), "--recipe", "tiny"], capture_output=True, text=True, timeout=300)
        assert (art / IN_PROGRESS).is_file()
    assert child.returncode == 3, child.stderr
    assert one_line(child.stderr).startswith("error: ") and f"pid {os.getpid()}" in child.stderr
    assert not (art / IN_PROGRESS).exists()  # a complete build: the marker goes with the lock


# ------------------------------------------------------------------------------------ signing


def test_sign_and_verify_with_a_key_made_here(art, capsys, tmp_path):
    private, public = keypair(tmp_path, "publisher")
    _, other = keypair(tmp_path, "someone-else")
    rc, out, _ = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)
    assert rc == 0 and f"{SIGNATURE}  (signature" in out and (art / SIGNATURE).is_file()
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")
    data = json.loads(out)
    assert rc == 0 and data["signature"]["state"] == "verified"
    assert data["signature"]["files"] == len(open_artifact(art).signed_files())

    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", other)  # the wrong key
    assert rc == 1 and "does not verify with the trusted key" in out
    rc, _, err = cli(capsys, "serve", art, "--profile", "base", "--dry-run", "--trust-key", other)
    assert rc == 1 and "signature INVALID" in one_line(err)

    good = (art / SIGNATURE).read_bytes()
    bundle = json.loads(good)
    sig = bundle["messageSignature"]["signature"] if "messageSignature" in bundle else None
    if sig is None:  # a DSSE envelope: its signature
        env = bundle["dsseEnvelope"]
        env["signatures"][0]["sig"] = ("A" if env["signatures"][0]["sig"][0] != "A" else "B") + \
            env["signatures"][0]["sig"][1:]
    (art / SIGNATURE).write_text(json.dumps(bundle))  # a tampered signature
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public)
    assert rc == 1 and "signature INVALID" in out
    (art / SIGNATURE).write_bytes(good)

    md = art / VALIDATION.named(".md")  # a tampered file, re-sealed: the provenance agrees, the signature not
    md.write_text(md.read_text() + "\nedited\n")
    seal_reports(art)
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public)
    assert rc == 1 and "has other bytes than the signature records" in out
    assert open_artifact(art, trusted=[public]).signature.mismatched == [PROVENANCE, VALIDATION.named(".md")]


def test_a_downloaded_artifact_is_served_signed_validated_here_or_forced(art, capsys, tmp_path, tiny_checkpoint,
                                                                         monkeypatch):
    from hybrid_build.core.local_trust import TRUST_ENV

    private, public = keypair(tmp_path, "publisher")
    rc, out, _ = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private, "--json")
    assert rc == 0
    monkeypatch.setenv(TRUST_ENV, str(tmp_path / "downloader-trust"))  # another machine: it built nothing
    down = tmp_path / "downloaded"  # what the repository holds, as `hf download` writes it
    for f in json.loads(out)["files"]:
        dst = down / f["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = art / (REPORTS["card"].main if f["path"] == "README.md" else f["path"])
        shutil.copyfile(src, dst)
    rc, _, err = cli(capsys, "serve", down, "--profile", "base", "--dry-run")
    assert rc == 1 and "downloaded" in one_line(err) and "not validated here" in err
    rc, out, err = cli(capsys, "serve", down, "--profile", "base", "--dry-run", "--trust-key", public,
                       "--source", tiny_checkpoint)
    assert rc == 0, err
    assert "signature verified: signed by key sha256:" in err and "vllm serve" in out
    rc, out, err = cli(capsys, "serve", down, "--profile", "base", "--dry-run", "--force", "--source", tiny_checkpoint)
    assert rc == 0 and "warning:" in err and "not validated here" in err
