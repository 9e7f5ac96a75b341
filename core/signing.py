"""Signing an artifact with OpenSSF Model Signing (the ``model-signing`` package) and checking a
signature: who signed it, and that every file it names has the bytes it records.

The signature (``SIGNATURE``, at the artifact's root, the library's default name) is a Sigstore
bundle over a manifest of per-file sha256 digests (the library's "files" serialization). ``publish``
signs the set of files it uploads, with the generated card as ``README.md``, so that the signature
holds for the repository as downloaded, and anyone can check it with the library's own CLI
(``model_signing verify key --signature model.sig --public_key KEY.pub FOLDER``).

Checking here verifies the bundle with the library and then compares the manifest it signed with the
digests the bound artifact has already established (``core.integrity``'s stat-keyed hash cache), so
a 71 GB artifact is not hashed a second time at every ``serve``.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .artifact import SIGNATURE  # OpenSSF Model Signing's default name, at the model's root
from .bounded_read import InputRefused, read_json
from .errors import UserError


@dataclass(frozen=True)
class SigningKey:
    """What signs: ``kind`` ``key`` (an EC private key, PEM), ``certificate`` (a key plus its
    certificate chain) or ``sigstore`` (keyless, needs the network)."""

    kind: str
    private_key: Path | None = None
    certificate: Path | None = None
    chain: tuple[Path, ...] = ()


@dataclass
class SignatureCheck:
    """``state``: ``verified`` (by a trusted identity, every file matches), ``untrusted`` (valid, but
    no trusted identity was given or it is another one), ``invalid`` (the bundle does not verify, or a
    file differs: ``problem`` names it) or ``unsigned``."""

    state: str
    signer: str | None = None
    problem: str | None = None
    files: int = 0
    seconds: float = 0.0
    mismatched: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.state == "verified"

    def line(self) -> str:
        if self.state == "verified":
            return f"signature verified: signed by {self.signer}, {self.files} files match"
        if self.state == "untrusted":
            return f"signature valid but signed by {self.signer}, not a trusted identity (--trust-key)"
        if self.state == "invalid":
            return f"signature INVALID: {self.problem}"
        return f"unsigned (no {SIGNATURE})"

    def to_json(self) -> dict:
        return {"state": self.state, "signer": self.signer, "problem": self.problem, "files": self.files,
                "seconds": round(self.seconds, 3)}


def key_fingerprint(public_pem: bytes) -> str:
    """``sha256:`` and the first 16 hex digits of the DER public key: how a key signer is named."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(public_pem)
    except ValueError:
        key = serialization.load_pem_private_key(public_pem, None).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "key sha256:" + hashlib.sha256(der).hexdigest()[:16]


def sign_files(files: dict[str, Path | bytes], signature: Path, key: SigningKey) -> float:
    """Sign ``files`` (name in the repository -> the local file, or the bytes of a generated one) into
    ``signature``; returns the seconds it took. The library hashes a folder, so the set is laid out as a
    view: a symbolic link per local file and the generated
    bytes, in a temporary folder beside the signature, removed after. The links are the view's own,
    to files the caller has checked as regular files of the artifact; the signed manifest names
    each by its place in the repository."""
    import time

    from model_signing import hashing, signing

    t0 = time.perf_counter()
    signature.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sign-view-", dir=signature.parent) as view:
        root = Path(view)
        for name, src in files.items():
            dst = root / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, bytes):
                dst.write_bytes(src)
                continue
            os.symlink(Path(src).resolve(), dst)  # a hard link would move the file's ctime (the hash cache's key)
        cfg = signing.Config().set_hashing_config(
            hashing.Config().use_file_serialization(hashing_algorithm="sha256").set_allow_symlinks(True))
        if key.kind == "key":
            cfg.use_elliptic_key_signer(private_key=key.private_key)
        elif key.kind == "certificate":
            cfg.use_certificate_signer(private_key=key.private_key, signing_certificate=key.certificate,
                                       certificate_chain=list(key.chain))
        elif key.kind == "sigstore":
            cfg.use_sigstore_signer()
        else:
            raise UserError(f"unknown signing method {key.kind!r} (key, certificate, sigstore)")
        tmp = signature.with_name(signature.name + ".partial")
        try:
            cfg.sign(root, tmp)
            os.replace(tmp, signature)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, e.strerror, str(signature)) from None
        except Exception:
            tmp.unlink(missing_ok=True)
            raise
    return time.perf_counter() - t0


SIGNATURE_CAP = 16 << 20  # a Sigstore bundle over a manifest of a few hundred files is tens of KB


def read_bundle_json(signature: Path) -> dict:
    """The signature file checked before the library reads it (``core/bounded_read``): a regular file
    (a FIFO in its place is refused, never waited on), at most ``SIGNATURE_CAP`` bytes, JSON nested at
    most ``MAX_DEPTH`` deep. A refusal is one line, exit 2."""
    data = read_json(signature, SIGNATURE, SIGNATURE_CAP)
    if not isinstance(data, dict):
        raise InputRefused(f"{SIGNATURE}: not a Sigstore bundle (a JSON object)")
    return data


def signed_manifest(signature: Path, trusted: list[Path]) -> tuple[str, dict[str, str]]:
    """Who signed ``signature`` (the first key of ``trusted`` it verifies with) and the digests it
    signed (name -> sha256 hex). Raises ``ValueError`` when no key verifies it."""
    from model_signing import verifying
    from model_signing._signing import sign_ec_key
    from model_signing._signing.sign_sigstore_pb import Signature

    read_bundle_json(signature)
    try:
        bundle = Signature.read(signature)
    except Exception as e:  # noqa: BLE001 - a bundle of another shape: KeyError, TypeError, the library's own
        raise ValueError(f"{SIGNATURE} does not parse as a Sigstore bundle ({type(e).__name__})") from None
    last: Exception | None = None
    for key in trusted:
        cfg = verifying.Config().use_elliptic_key_verifier(public_key=key)
        # the bundle's signature and its payload, checked by the library; the files are compared below
        verifier: sign_ec_key.Verifier = cfg._verifier
        try:
            manifest = verifier.verify(bundle)
        except Exception as e:  # noqa: BLE001 - the library raises ValueError or its own errors
            last = e
            continue
        digests = {str(rd.identifier): rd.digest.digest_hex for rd in manifest.resource_descriptors()}
        return key_fingerprint(key.read_bytes()), digests
    raise ValueError(" ".join(str(last).split()) if last else "no trusted key was given")


def check_signature(signature: Path, expected: dict[str, str], trusted: list[Path]) -> SignatureCheck:
    """The signature at ``signature`` against ``expected`` (name -> sha256 of the file that name holds
    in the artifact as served and published), verified with the ``trusted`` public keys."""
    import time

    t0 = time.perf_counter()
    if not os.path.lexists(signature):
        return SignatureCheck("unsigned")
    read_bundle_json(signature)  # a FIFO, an endless file or deep nesting: one line, never a hang or a traceback
    if not trusted:
        try:
            from model_signing._signing.sign_sigstore_pb import Signature

            Signature.read(signature)
        except Exception as e:  # noqa: BLE001
            return SignatureCheck("invalid", problem=f"{SIGNATURE} does not parse ({' '.join(str(e).split())[:120]})")
        return SignatureCheck("untrusted", signer="an identity not checked (no --trust-key given)")
    try:
        signer, digests = signed_manifest(signature, trusted)
    except (ValueError, OSError) as e:
        return SignatureCheck("invalid", problem=f"{SIGNATURE} does not verify with the trusted key(s): "
                                                 f"{str(e)[:160]}", seconds=time.perf_counter() - t0)
    bad = sorted(n for n in set(digests) | set(expected) if digests.get(n) != expected.get(n))
    if bad:
        n = bad[0]
        why = ("is not in the signed manifest" if n not in digests else "is signed but missing" if n not in expected
               else "has other bytes than the signature records")
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return SignatureCheck("invalid", signer, f"{n} {why}{more}", len(digests), time.perf_counter() - t0, bad)
    return SignatureCheck("verified", signer, None, len(digests), time.perf_counter() - t0)
