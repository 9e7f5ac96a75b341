"""The trust boundary: what a folder says about itself is never believed. Each attack runs the real
commands on a copy of the tiny checkpoint's validated artifact, as a download would give it (no
work folder), on "another machine" (an empty ``HYBRID_BUILD_TRUST_DIR``: it built and validated
nothing), unless it says otherwise."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hybrid_build.core import local_trust
from hybrid_build.core.artifact import VALIDATED_HERE, WORK_DIR, provenance_sha256
from hybrid_build.core.signing import SIGNATURE
from hybrid_build.pipeline.cli import main

REPO = "my-org/tiny-hybrid"
RECORD = f"{WORK_DIR}/record.json"


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def keypair(where: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where / f"{name}.pem", where / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def download(validated_artifact, tmp_path) -> Path:
    """The validated artifact copied without its work folder: what a Hub download gives."""
    dst = tmp_path / "downloaded"
    shutil.copytree(validated_artifact, dst, ignore=shutil.ignore_patterns(WORK_DIR))
    return dst


@pytest.fixture
def serve(capsys, tiny_checkpoint):
    """``serve(art, *flags)``: ``serve --dry-run`` of the base profile (the source given: a copy has no
    record of where it is)."""
    def run(art: Path, *extra) -> tuple[int, str, str]:
        return cli(capsys, "serve", art, "--profile", "base", "--dry-run", "--source", tiny_checkpoint, *extra)
    return run


# ------------------------------------------------------------------ trust that a download can forge


def test_the_machine_that_built_it_serves_it_wherever_it_is(validated_artifact, download, serve):
    """The record is the build's (its bytes), kept in the state folder: the copy is served as built here."""
    build = provenance_sha256(validated_artifact)
    record = local_trust.recalled(build, local_trust.BUILT)
    assert record and record[local_trust.BUILT] == str(validated_artifact.resolve())
    rc, out, err = serve(download)
    assert rc == 0, err
    assert "vllm serve" in out and "carries trust records" not in err


def test_a_copy_on_another_machine_is_not_served(download, another_machine, serve):
    rc, _, err = serve(download)
    assert rc == 1
    assert "downloaded (unsigned (no model.sig)) and not validated here" in lines(err)[-1]


@pytest.mark.parametrize("claim", ["record", "validated-here"])
def test_a_trust_record_inside_the_folder_gains_nothing_and_is_named(download, another_machine, serve, capsys,
                                                                      claim):
    """``.hybrid-build/record.json`` holding ``{}``, or a validated-here record naming this very build:
    the copy is refused as before, and serve and status say in one line that the file is ignored."""
    (download / WORK_DIR).mkdir()
    if claim == "record":
        rel, text = RECORD, "{}"
    else:
        rel, text = VALIDATED_HERE, json.dumps({"build": provenance_sha256(download), "at": "2026-01-01T00:00:00Z"})
    (download / rel).write_text(text)
    rc, _, err = serve(download)
    assert rc == 1, err
    said = [ln for ln in lines(err) if "carries trust records" in ln]
    assert said == [f"{download}: carries trust records from elsewhere ({rel}): ignored; this machine's own are "
                    "kept in its state folder"]
    assert "not validated here" in lines(err)[-1]
    rc, out, _ = cli(capsys, "status", download)
    assert rc == 0
    trust = [ln for ln in lines(out) if ln.startswith("trust")]
    assert trust == ["trust    neither built nor validated on this machine",
                     f"trust    carries trust records from elsewhere ({rel}): ignored; this machine's own are kept "
                     "in its state folder"]
    rc, out, _ = cli(capsys, "status", download, "--json")
    assert json.loads(out)["trust"]["foreign"] == [rel]
    assert not any(another_machine.rglob("*.json"))  # nothing of it became a record here


def test_validate_here_records_the_pass_in_the_state_folder_not_in_the_artifact(download, another_machine, serve,
                                                                              tiny_checkpoint, capsys):
    rc, _, err = cli(capsys, "validate", download, "--source", tiny_checkpoint, "--no-e2e", "-q")
    assert rc == 0, err
    assert not (download / VALIDATED_HERE).exists()
    record = local_trust.recalled(provenance_sha256(download), local_trust.VALIDATED)
    assert record and record[local_trust.VALIDATED] == str(download.resolve())
    rc, _, err = serve(download)
    assert rc == 0, err
    assert "served after a passing local `hybrid-build validate`" in err


def test_with_trust_key_a_download_without_its_signature_is_refused(validated_artifact, tmp_path, another_machine,
                                                                   serve, tiny_checkpoint, capsys):
    """Signed by the publisher, then ``model.sig`` removed: with ``--trust-key`` it is refused, whether
    the folder claims a local validate or this machine really validated it."""
    private, public = keypair(tmp_path, "publisher")
    signed = tmp_path / "signed"
    shutil.copytree(validated_artifact, signed)
    rc, _, err = cli(capsys, "publish", signed, "--repo-id", REPO, "--dry-run", "--sign-key", private)
    assert rc == 0, err
    down = tmp_path / "down"
    shutil.copytree(signed, down, ignore=shutil.ignore_patterns(WORK_DIR))
    rc, _, err = serve(down, "--trust-key", public)
    assert rc == 0 and "signature verified: signed by key sha256:" in err, err

    (down / SIGNATURE).unlink()
    (down / WORK_DIR).mkdir(exist_ok=True)
    (down / VALIDATED_HERE).write_text(json.dumps({"build": provenance_sha256(down)}))  # forged
    rc, _, err = serve(down, "--trust-key", public)
    assert rc == 1
    assert "--trust-key asks for a signature by a trusted key" in lines(err)[-1] and "unsigned" in lines(err)[-1]
    rc, _, err = cli(capsys, "validate", down, "--source", tiny_checkpoint, "--no-e2e", "-q")
    assert rc == 0, err  # now this machine did validate it
    rc, _, err = serve(down, "--trust-key", public)
    assert rc == 1 and "a local validate does not stand in for it" in lines(err)[-1]
    rc, _, err = serve(down)  # no publisher named: the local validate will do
    assert rc == 0, err
