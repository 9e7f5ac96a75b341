"""Signing and verifying an artifact with OpenSSF Model Signing, against the hash rate measured in the
same run, and the time for a 71 GB artifact computed from it.

    python benchmarks/signing.py ARTIFACT [--bytes N]

Measures, on ARTIFACT (the demo: `hybrid-build run -o OUT`): sha256 over its files (the baseline:
what any full check costs), `publish`'s signing (a key made here), the library's own full verify
(hashes every file again), hybrid-build's first check (the library's public verify on a view of the
files: hashes them too) and its next check of the same inputs (the verdict kept in the state folder).
With --bytes it first writes a file of N random bytes into a scratch copy, so that the hash rate is
measured on more than the demo's few MB.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GB71 = 71e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--bytes", type=int, default=0, help="a scratch file of this many bytes for the hash rate")
    args = ap.parse_args()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from model_signing import hashing, verifying

    from hybrid_build.core.bound import open_artifact
    from hybrid_build.core.signing import SigningKey, check_signature, sign_files

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        key = ec.generate_private_key(ec.SECP256R1())
        (tmp / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
        (tmp / "k.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
        bound = open_artifact(args.artifact)
        files = {n: args.artifact / n for n in bound.shipped()}
        if args.bytes:
            big = tmp / "scratch.bin"
            with open(big, "wb") as f:
                left = args.bytes
                while left:
                    n = min(left, 64 << 20)
                    f.write(os.urandom(n))
                    left -= n
            files["scratch.bin"] = big
        total = sum(p.stat().st_size for p in files.values())

        t0 = time.perf_counter()  # the baseline: sha256 of every byte, one thread
        for p in files.values():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        base = time.perf_counter() - t0

        sig = tmp / "model.sig"
        sign = sign_files(files, sig, SigningKey("key", tmp / "k.pem"))

        view = tmp / "view"  # the library's full verify wants the folder as signed
        for n, p in files.items():
            (view / n).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(p.resolve(), view / n)
        t0 = time.perf_counter()
        cfg = verifying.Config().use_elliptic_key_verifier(public_key=tmp / "k.pub")
        cfg.set_hashing_config(hashing.Config().use_file_serialization(hashing_algorithm="sha256")
                               .set_allow_symlinks(True))
        cfg.verify(view, sig)
        full = time.perf_counter() - t0

        os.environ["HYBRID_BUILD_TRUST_DIR"] = str(tmp / "trust")  # a fresh state folder: no verdict yet
        expected = {n: (p, hashlib.sha256(p.read_bytes()).hexdigest()) for n, p in files.items()}
        first = check_signature(sig, expected, [tmp / "k.pub"])
        check = check_signature(sig, expected, [tmp / "k.pub"])
        assert first.verified and not first.cached and check.verified and check.cached, (first, check)
        shutil.rmtree(view)

    rate = total / base
    print(f"files: {len(files)}, {total / 1e6:.1f} MB (python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    print(f"sha256 baseline (one thread): {base:.3f} s, {rate / 1e6:.0f} MB/s")
    print(f"sign (model-signing, hashes every file): {sign:.3f} s = {sign / base:.2f}x the baseline")
    print(f"verify, library's full (hashes every file): {full:.3f} s = {full / base:.2f}x the baseline")
    print(f"verify, hybrid-build's first (the library's public verify): {first.seconds:.3f} s = "
          f"{first.seconds / base:.2f}x the baseline")
    print(f"verify, hybrid-build's next (the verdict kept in the state folder): {check.seconds:.3f} s")
    fixed = max(sign - base, 0.0)
    print(f"71 GB at the measured rate: hash {GB71 / rate:.0f} s; sign ~{GB71 / rate + fixed:.0f} s; full verify "
          f"~{GB71 / rate + max(full - base, 0):.0f} s (hybrid-build's first check, once); its next checks "
          f"{check.seconds:.2f} s while the hash cache holds the files' digests")


if __name__ == "__main__":
    main()
