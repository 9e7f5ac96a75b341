"""The trust boundary: what a folder says about itself is never believed. Each attack runs the real
commands on a copy of the tiny checkpoint's validated artifact, as a download would give it (no
work folder), on "another machine" (an empty ``HYBRID_BUILD_TRUST_DIR``: it built and validated
nothing), unless it says otherwise."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from signing_keys import certificate_pair, keypair

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


def test_status_reads_no_source_path_a_copied_work_folder_names(art, another_machine, capsys):
    """A copy with its work folder names the source's path on the machine that built it; a folder there may
    exist here too (here: the very source). On a machine that built nothing in it, status neither hashes nor
    trusts that path, and says why."""
    rc, out, err = cli(capsys, "status", art, "--json")
    source = json.loads(out)["source"]
    assert source["state"] == "unchecked", source
    assert "reads no path a folder from elsewhere names" in source["reason"], source


def test_stage_manifests_carried_in_a_folder_let_no_stage_be_skipped(art, tiny_checkpoint, another_machine, caplog):
    """A copy with its work folder: every stage manifest, with keys that match this source and recipe. A
    machine that did not write them runs every stage (-vv says why); the manifests it writes then count.
    A manifest changed after it was written is not this machine's either."""
    import logging

    from hybrid_build.pipeline.build import prepare
    from hybrid_build.pipeline.runner import run_build

    def statuses() -> dict[str, str]:
        return {r.stage: r.status for r in run_build(prepare(tiny_checkpoint, art, "tiny"))}

    with caplog.at_level(logging.DEBUG, logger="hybrid_build.pipeline.runner"):
        first = statuses()
    assert set(first.values()) == {"ran"}, first
    assert "assemble: its manifest was not written on this machine (or was changed since)" in caplog.text
    assert set(statuses().values()) == {"skipped"}
    manifest = art / WORK_DIR / "calibrate.json"
    data = json.loads(manifest.read_text())
    data["seconds"] += 1.0  # the same key and outputs: only its bytes differ from what was written
    manifest.write_text(json.dumps(data, indent=2) + "\n")
    assert statuses()["calibrate"] == "ran"


def test_the_machine_that_built_it_serves_it_wherever_it_is(validated_artifact, download, serve):
    """The record is the build's (its bytes), kept in the state folder: the copy is served as built here.
    (The folder it names is the last one this build was made in: the suite builds the same bytes twice.)"""
    build = provenance_sha256(validated_artifact)
    record = local_trust.recalled(build, local_trust.BUILT)
    assert record and record["build"] == build and Path(record[local_trust.BUILT]).is_absolute()
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


# ------------------------------------------------------------------ names that point outside the folder


def _list_outside(art: Path, name: str, target: Path) -> None:
    """What an attacker does: a provenance entry ``name`` with the right size and sha256 of ``target``,
    a file outside the artifact."""
    import hashlib

    prov = art / "hybrid_build" / "provenance.json"
    data = json.loads(prov.read_text())
    data["files"][name] = {"bytes": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    prov.write_text(json.dumps(data, indent=2) + "\n")


@pytest.mark.parametrize("how", ["parent", "absolute", "through-a-folder"])
def test_a_provenance_entry_outside_the_folder_is_refused_everywhere(validated_artifact, tmp_path, capsys, how):
    art = tmp_path / "art"
    shutil.copytree(validated_artifact, art)
    outside = tmp_path / "outside.txt"
    outside.write_text("a file of the user's, next to the artifact\n")
    name = {"parent": "../outside.txt", "absolute": str(outside),
            "through-a-folder": "hybrid_build/../../outside.txt"}[how]
    _list_outside(art, name, outside)
    private, _ = keypair(tmp_path, "publisher")
    for argv in (["status", art], ["verify-artifact", art], ["publish", art, "--repo-id", REPO, "--dry-run"],
                 ["publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private],
                 ["serve", art, "--profile", "base", "--dry-run"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 1, (argv, out, err)
        why = "is an absolute path" if how == "absolute" else "climbs out through '..'"
        assert lines(err) == [f"error: {art / 'hybrid_build' / 'provenance.json'}: files: {name!r} {why}: not a "
                              "name inside the artifact; rebuild the artifact"], argv
        assert "outside.txt" not in out
    assert not (art / SIGNATURE).exists()
    assert not [p for p in art.rglob("*") if p.is_symlink()]  # signing linked nothing


def test_a_folder_that_links_outside_is_never_read_through(validated_artifact, tmp_path, capsys, monkeypatch):
    """``extra/`` a symbolic link to a folder outside, and the provenance listing ``extra/outside.txt``
    with its right size and sha256: refused, naming it, and the outside file is never hashed."""
    from hybrid_build.core import integrity

    art = tmp_path / "art"
    shutil.copytree(validated_artifact, art)
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "outside.txt"
    outside.write_text("a file of the user's\n")
    (art / "extra").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    _list_outside(art, "extra/outside.txt", outside)
    hashed: list[Path] = []
    real = integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda path, st: hashed.append(Path(path)) or real(path, st))
    for argv in (["status", art, "--json"], ["verify-artifact", art], ["publish", art, "--repo-id", REPO, "--dry-run"]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 1, (argv, out, err)
        assert "extra is a symbolic link" in out + err, argv
    data = json.loads(cli(capsys, "status", art, "--json")[1])
    assert "extra/outside.txt leads outside the artifact" in " ".join(data["artifact"]["problems"])
    assert all(outside.resolve() != p.resolve() for p in hashed), hashed


# ------------------------------------------------------------------ signatures that can be verified


def test_a_certificate_signature_verifies_against_its_ca_and_no_other(art, tmp_path, capsys, another_machine,
                                                                      serve):
    ca, key, cert = certificate_pair(tmp_path, "Test Publisher CA", "publisher.example")
    other_ca, _, _ = certificate_pair(tmp_path, "Another CA", "someone.example")
    rc, _, err = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", key, "--sign-cert", cert,
                     "--sign-chain", ca)
    assert rc == 0, err
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", ca, "--json")
    sig = json.loads(out)["signature"]
    assert rc == 0 and sig["state"] == "verified", sig
    assert sig["signer"] == "certificate CN=publisher.example (issued by CN=Test Publisher CA)"
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", other_ca)
    assert rc == 1 and "signature INVALID: model.sig does not verify with the trusted key(s)" in out
    down = tmp_path / "down"  # on a machine that built nothing, the CA alone lets it be served
    shutil.copytree(art, down, ignore=shutil.ignore_patterns(WORK_DIR))
    rc, _, err = serve(down, "--trust-key", ca)
    assert rc == 0 and "signed by certificate CN=publisher.example" in err, err
    rc, _, err = serve(down, "--trust-key", other_ca)
    assert rc == 1 and "signature INVALID" in lines(err)[-1]


def test_without_a_trusted_key_the_signer_is_named_and_nothing_is_called_sound(art, tmp_path, capsys):
    private, _ = keypair(tmp_path, "publisher")
    assert cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)[0] == 0
    rc, out, _ = cli(capsys, "verify-artifact", art)
    assert rc == 0
    assert "sound" not in out
    signer = json.loads(cli(capsys, "verify-artifact", art, "--json")[1])["signature"]["signer"]
    assert signer.startswith("key sha256:")
    assert lines(out)[-1] == (f"artifact consistent with its own provenance; its signature names {signer} but was "
                              "NOT checked (no --trust-key given): nobody vouches for these files")
    rc, out, _ = cli(capsys, "verify-artifact", art, "--require-signature")
    assert rc == 1 and "NOT sound" in lines(out)[-1] and "nobody's signature was verified" in lines(out)[-1]


def test_keyless_sigstore_signing_is_refused_in_one_line(art, capsys):
    rc, _, err = cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sigstore")
    assert rc == 2 and len(lines(err)) == 1 and "keyless Sigstore signing is not offered" in err
    assert not (art / SIGNATURE).exists()


def test_a_verified_signature_is_remembered_until_a_file_changes(art, tmp_path, capsys, monkeypatch):
    """The first check hashes the files through the library; the next one of the same inputs reads the
    verdict from the state folder; a changed report (re-sealed) is checked afresh and fails."""
    from hybrid_build.core.artifact import REPORTS, seal_reports

    private, public = keypair(tmp_path, "publisher")
    assert cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)[0] == 0
    first = json.loads(cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")[1])["signature"]
    second = json.loads(cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")[1])["signature"]
    assert (first["state"], first["cached"], second["state"], second["cached"]) == ("verified", False,
                                                                                   "verified", True)
    md = art / REPORTS["validation"].named(".md")
    md.write_text(md.read_text() + "\nedited\n")
    seal_reports(art)
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")
    sig = json.loads(out)["signature"]
    assert rc == 1 and sig["state"] == "invalid" and not sig["cached"]
    assert "has other bytes than the signature records" in sig["problem"]


def test_a_remembered_verdict_does_not_cover_a_file_changed_in_place(art, tmp_path, capsys):
    """A signed file edited after a verified check (its provenance not re-sealed): the remembered verdict
    does not stand in for it; the signature is invalid, naming the file."""
    from hybrid_build.core.artifact import REPORTS

    private, public = keypair(tmp_path, "publisher")
    assert cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)[0] == 0
    first = json.loads(cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")[1])["signature"]
    assert first["state"] == "verified"
    md = art / REPORTS["validation"].named(".md")
    md.write_text(md.read_text() + "\nedited\n")
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")
    sig = json.loads(out)["signature"]
    assert rc == 1 and sig["state"] == "invalid" and not sig["cached"], sig
    assert sig["problem"].startswith(f"{md.relative_to(art)} has other bytes than the signature records"), sig


def test_a_signed_card_linked_outside_is_a_problem_line_not_a_crash(art, tmp_path, capsys):
    from hybrid_build.core.artifact import REPORTS

    private, public = keypair(tmp_path, "publisher")
    assert cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)[0] == 0
    card = art / REPORTS["card"].main
    outside = tmp_path / "outside.md"
    outside.write_text("# not the card\n")
    card.unlink()
    card.symlink_to(outside)
    rc, out, _ = cli(capsys, "verify-artifact", art, "--trust-key", public, "--json")
    sig = json.loads(out)["signature"]
    assert rc == 1 and sig["state"] == "invalid" and "leads outside the artifact" in sig["problem"], sig


def test_a_signature_naming_a_file_outside_is_refused_unopened(art, tmp_path, capsys):
    import base64

    private, public = keypair(tmp_path, "publisher")
    assert cli(capsys, "publish", art, "--repo-id", REPO, "--dry-run", "--sign-key", private)[0] == 0
    bundle = json.loads((art / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"].append({"name": "../outside.txt", "algorithm": "sha256", "digest": "0" * 64})
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (art / SIGNATURE).write_text(json.dumps(bundle))
    for trust in ([], ["--trust-key", public]):
        rc, out, _ = cli(capsys, "verify-artifact", art, *trust)
        assert rc == 1
        assert ("signature INVALID: model.sig is not a signature this tool can read (it lists '../outside.txt' "
                "climbs out through '..': not a name inside the artifact)") in out


def test_an_index_entry_outside_the_folder_is_refused_and_never_opened(art, tmp_path, capsys, monkeypatch):
    """The index maps a tensor to ``../outside.safetensors`` (a real safetensors file there), and the
    provenance is rewritten to match: refused naming the entry; the card's header reading never
    opens it."""
    import hashlib

    from hybrid_build.core import safetensors_io

    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(next(art.glob("model-*.safetensors")), outside)
    index = art / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "../outside.safetensors"
    index.write_text(json.dumps(data, indent=2))
    prov = art / "hybrid_build" / "provenance.json"
    p = json.loads(prov.read_text())
    p["files"][index.name] = {"bytes": index.stat().st_size, "sha256": hashlib.sha256(index.read_bytes()).hexdigest()}
    prov.write_text(json.dumps(p, indent=2) + "\n")
    opened: list[Path] = []
    real = safetensors_io.open_regular
    monkeypatch.setattr(safetensors_io, "open_regular", lambda path, *a: opened.append(Path(path)) or real(path, *a))
    want = ("model.safetensors.index.json: '../outside.safetensors' climbs out through '..': not a name inside the "
            "artifact")
    for argv in (["verify-artifact", art], ["publish", art, "--repo-id", REPO, "--dry-run"], ["status", art]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 1 and want in out + err, (argv, out, err)
    assert all(p.resolve() != outside.resolve() for p in opened)
