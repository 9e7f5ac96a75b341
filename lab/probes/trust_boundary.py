"""Re-runs the attacks on the trust boundary (trust a download can forge, names that point outside
the folder, signatures nobody can check) on fresh copies of the demo artifact, and prints per case
the command, its exit code and the line that matters.

    hybrid-build run -o DEMO            # the demo artifact, built on this machine
    python lab/probes/trust_boundary.py DEMO WORKDIR [CASE ...]

"Another machine" is a fresh, empty HYBRID_BUILD_TRUST_DIR under WORKDIR (it built and validated
nothing). Each case copies DEMO into WORKDIR/<case>; DEMO is not changed. A probe: it prints.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from artifact_holes import report, run_cases  # beside this file (lab/probes is the script's folder)

CLI = [sys.executable, "-m", "hybrid_build.pipeline.cli"]
WORK_DIR = ".hybrid-build"


def sh(args, env=None) -> tuple[int, str]:
    p = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, env={**os.environ, **(env or {})})
    return p.returncode, p.stdout + p.stderr


def line(out: str, needle: str | None = None) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if needle:
        return next((ln for ln in lines if needle in ln), f"(no line with {needle!r})")
    return lines[-1] if lines else "(no output)"


def copy(demo: Path, work: Path, case: str, work_folder: bool = False) -> Path:
    dst = work / case
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(demo, dst, symlinks=True, ignore=None if work_folder else shutil.ignore_patterns(WORK_DIR))
    return dst


def elsewhere(work: Path, case: str) -> dict:
    folder = work / f"{case}-trust"
    shutil.rmtree(folder, ignore_errors=True)
    return {"HYBRID_BUILD_TRUST_DIR": str(folder)}


def keys(work: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private, public = work / "publisher.pem", work / "publisher.pub"
    if not private.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def build_digest(art: Path) -> str:
    from hybrid_build.core.artifact import provenance_sha256

    return provenance_sha256(art)


# ------------------------------------------------------------------ trust a download can forge


def downloaded(demo, work):
    art, env = copy(demo, work, "downloaded"), elsewhere(work, "downloaded")
    rc, out = sh(["serve", art, "--dry-run", "--source", demo / WORK_DIR / "demo-source"], env)
    report("downloaded", "serve --dry-run (another machine)", rc, line(out))
    rc, out = sh(["serve", demo, "--dry-run"])
    report("downloaded", "serve --dry-run (the original, built here)", rc, line(out, "vllm serve") if rc == 0
           else line(out))


def record_json(demo, work):
    art, env = copy(demo, work, "record-json"), elsewhere(work, "record-json")
    (art / WORK_DIR).mkdir()
    (art / WORK_DIR / "record.json").write_text("{}")
    rc, out = sh(["serve", art, "--dry-run", "--source", demo / WORK_DIR / "demo-source"], env)
    report("record-json", "serve --dry-run", rc, line(out, "carries trust records"))
    report("record-json", "serve --dry-run", rc, line(out))
    rc, out = sh(["status", art], env)
    report("record-json", "status", rc, line(out, "carries trust records"))


def validated_here(demo, work):
    art, env = copy(demo, work, "validated-here"), elsewhere(work, "validated-here")
    (art / WORK_DIR).mkdir()
    (art / WORK_DIR / "validated-here.json").write_text(json.dumps({"build": build_digest(art)}))
    rc, out = sh(["serve", art, "--dry-run", "--source", demo / WORK_DIR / "demo-source"], env)
    report("validated-here", "serve --dry-run", rc, line(out, "carries trust records"))
    report("validated-here", "serve --dry-run", rc, line(out))


def unsigned_with_trust_key(demo, work):
    private, public = keys(work)
    signed = copy(demo, work, "signed", work_folder=True)
    rc, out = sh(["publish", signed, "--repo-id", "me/demo", "--dry-run", "--sign-key", private])
    art, env = copy(signed, work, "sig-removed"), elsewhere(work, "sig-removed")
    src = demo / WORK_DIR / "demo-source"
    rc, out = sh(["serve", art, "--dry-run", "--source", src, "--trust-key", public], env)
    report("sig-removed", "serve --trust-key (signed, as published)", rc, line(out, "signature verified"))
    (art / "model.sig").unlink()
    (art / WORK_DIR).mkdir(exist_ok=True)
    (art / WORK_DIR / "validated-here.json").write_text(json.dumps({"build": build_digest(art)}))
    rc, out = sh(["serve", art, "--dry-run", "--source", src, "--trust-key", public], env)
    report("sig-removed", "serve --trust-key (model.sig removed)", rc, line(out))


# ------------------------------------------------------------------ names that point outside


def _list(art: Path, name: str, target: Path) -> None:
    prov = art / "hybrid_build/provenance.json"
    data = json.loads(prov.read_text())
    data["files"][name] = {"bytes": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    prov.write_text(json.dumps(data, indent=2) + "\n")


def outside(demo, work):
    private, _ = keys(work)
    target = work / "outside.txt"
    target.write_text("a file of the user's, next to the artifact\n")
    for case, name in (("outside-parent", "../outside.txt"), ("outside-absolute", str(target)),
                       ("outside-through", "hybrid_build/../../outside.txt")):
        art = copy(demo, work, case, work_folder=True)
        _list(art, name, target)
        for cmd in (["status", art], ["verify-artifact", art], ["publish", art, "--repo-id", "me/demo", "--dry-run"],
                    ["publish", art, "--repo-id", "me/demo", "--dry-run", "--sign-key", private]):
            rc, out = sh(cmd)
            report(case, " ".join(str(c) for c in cmd[:1] + cmd[2:]).replace(str(private), "KEY"), rc, line(out))
        links = [str(p.relative_to(art)) for p in art.rglob("*") if p.is_symlink()]
        report(case, "symbolic links left in the artifact", 0, ", ".join(links) or "none")


def index_outside(demo, work):
    art = copy(demo, work, "index-outside", work_folder=True)
    index = art / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../outside.safetensors"
    index.write_text(json.dumps(data, indent=2))
    prov = art / "hybrid_build/provenance.json"
    p = json.loads(prov.read_text())
    p["files"][index.name] = {"bytes": index.stat().st_size, "sha256": hashlib.sha256(index.read_bytes()).hexdigest()}
    prov.write_text(json.dumps(p, indent=2) + "\n")
    for cmd in (["verify-artifact", art], ["publish", art, "--repo-id", "me/demo", "--dry-run"]):
        rc, out = sh(cmd)
        report("index-outside", cmd[0], rc, line(out, "index") if rc else line(out))


def folder_link(demo, work):
    art = copy(demo, work, "folder-link", work_folder=True)
    (work / "elsewhere").mkdir(exist_ok=True)
    target = work / "elsewhere" / "outside.txt"
    target.write_text("a file of the user's\n")
    (art / "extra").symlink_to(work / "elsewhere", target_is_directory=True)
    _list(art, "extra/outside.txt", target)
    for cmd in (["verify-artifact", art], ["publish", art, "--repo-id", "me/demo", "--dry-run"]):
        rc, out = sh(cmd)
        report("folder-link", cmd[0], rc, line(out, "leads outside") if "leads outside" in out else line(out))


# ------------------------------------------------------------------ signatures


def unchecked(demo, work):
    private, public = keys(work)
    art = copy(demo, work, "unchecked", work_folder=True)
    sh(["publish", art, "--repo-id", "me/demo", "--dry-run", "--sign-key", private])
    rc, out = sh(["verify-artifact", art])
    report("unchecked", "verify-artifact (no --trust-key)", rc, line(out))
    rc, out = sh(["verify-artifact", art, "--trust-key", public])
    report("unchecked", "verify-artifact --trust-key", rc, line(out))
    rc, out = sh(["publish", art, "--repo-id", "me/demo", "--dry-run", "--sigstore"])
    report("sigstore", "publish --sigstore", rc, line(out))


def signature_outside(demo, work):
    private, public = keys(work)
    art = copy(demo, work, "sig-outside", work_folder=True)
    sh(["publish", art, "--repo-id", "me/demo", "--dry-run", "--sign-key", private])
    bundle = json.loads((art / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"].append({"name": "../outside.txt", "algorithm": "sha256", "digest": "0" * 64})
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (art / "model.sig").write_text(json.dumps(bundle))
    rc, out = sh(["verify-artifact", art, "--trust-key", public])
    report("sig-outside", "verify-artifact --trust-key", rc, line(out))


CASES = {f.__name__: f for f in (downloaded, record_json, validated_here, unsigned_with_trust_key, outside,
                                 index_outside, folder_link, unchecked, signature_outside)}


if __name__ == "__main__":
    run_cases(CASES)
