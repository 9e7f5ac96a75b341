"""Signing an artifact with OpenSSF Model Signing (the ``model-signing`` package) and checking a
signature: who signed it, and that every file it names has the bytes it records.

The signature (``SIGNATURE``, at the artifact's root, the library's default name) is a Sigstore
bundle over a manifest of per-file sha256 digests (the library's "files" serialization). ``publish``
signs the set of files it uploads, with the generated card as ``README.md``, so that the signature
holds for the repository as downloaded. Two ways to sign, both checked here with the library's
public verifiers, offline: an EC key (trusted as its public key) and a key with its certificate
(trusted as a CA certificate the chain leads to). Anyone can also check either with the library's
own CLI (``model_signing verify key`` / ``verify certificate``). Keyless Sigstore signing is not
offered: its check needs an identity, an issuer and Sigstore's online trust root.

A check verifies the bundle and every file with the library (``verifying.Config().verify``) on a
view of the files as signed (links to the artifact's files, the card as ``README.md``), which hashes
them; the verdict is then kept in the user's state folder (``core.local_trust``) keyed by the
signature's bytes, the files' digests (which ``core.integrity``'s stat-keyed cache establishes
without reading them) and the trusted keys, so a 71 GB artifact is hashed for its signature once,
not at every ``serve``. Without a trusted key nothing is verified: the check names the signer the
bundle claims and says so.
"""
from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .artifact import SIGNATURE  # OpenSSF Model Signing's default name, at the model's root
from .bounded_read import SECRET_CAP, parse_json, read_bytes
from .errors import ArtifactError, UserError
from .names import name_problem


@dataclass(frozen=True)
class SigningKey:
    """What signs: ``kind`` ``key`` (an EC private key, PEM) or ``certificate`` (that key plus its
    certificate and the certificates of its chain)."""

    kind: str
    private_key: Path | None = None
    certificate: Path | None = None
    chain: tuple[Path, ...] = ()


@dataclass
class SignatureCheck:
    """``state``: ``verified`` (by a trusted key or certificate, every file matches), ``unchecked``
    (no trusted key was given: ``signer`` is who the bundle claims, verified by nobody), ``invalid``
    (it does not verify with the trusted keys, names a file outside the artifact, does not parse, or
    a file differs: ``problem`` says which) or ``unsigned``."""

    state: str
    signer: str | None = None
    problem: str | None = None
    files: int = 0
    seconds: float = 0.0
    mismatched: list[str] = field(default_factory=list)
    cached: bool = False  # the verdict of an earlier check of the same inputs (core.local_trust)

    @property
    def verified(self) -> bool:
        return self.state == "verified"

    def line(self) -> str:
        if self.state == "verified":
            return f"signature verified: signed by {self.signer}, {self.files} files match"
        if self.state == "unchecked":
            return (f"signature NOT checked: it names {self.signer} as its signer, but no --trust-key was given, "
                    "so nobody's signature was verified")
        if self.state == "invalid":
            return f"signature INVALID: {self.problem}"
        return f"unsigned (no {SIGNATURE})"

    def to_json(self) -> dict:
        return {"state": self.state, "signer": self.signer, "problem": self.problem, "files": self.files,
                "seconds": round(self.seconds, 3), "cached": self.cached}


def key_fingerprint(pem: bytes) -> str:
    """How a key signer is named: ``key sha256:`` and the first 16 hex digits of the sha256 of its public
    key in PEM (SubjectPublicKeyInfo), the digest model-signing records in a bundle as the key's hint."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError:
        key = serialization.load_pem_private_key(pem, None).public_key()
    spki = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "key sha256:" + hashlib.sha256(spki).hexdigest()[:16]


def _certificate_name(der: bytes) -> str:
    from cryptography import x509

    cert = x509.load_der_x509_certificate(der)
    return f"certificate {cert.subject.rfc4514_string()} (issued by {cert.issuer.rfc4514_string()})"


@dataclass(frozen=True)
class Claim:
    """What a bundle says before anything is verified: the signer it names, how (``key``,
    ``certificate`` or ``sigstore``) and the digests it lists (name -> sha256 hex)."""

    signer: str
    kind: str
    digests: dict[str, str]


def read_claim(raw: bytes) -> Claim:
    """The bundle's claim, read from its documented JSON (a Sigstore bundle holding an in-toto
    statement of model-signing's predicate); ``ValueError`` when it is not one. Every name it lists
    must be a name inside the artifact (``core.names``)."""
    try:
        bundle = parse_json(raw, SIGNATURE, error=ValueError)  # nested at most MAX_DEPTH (core.bounded_read)
        material = bundle["verificationMaterial"]
        statement = parse_json(base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True),
                               f"{SIGNATURE}'s statement", error=ValueError)
        resources = statement["predicate"]["resources"]
        digests = {r["name"]: r["digest"] for r in resources if r["algorithm"] == "sha256"}
        if len(digests) != len(resources) or not all(isinstance(d, str) for d in digests.values()):
            raise ValueError("a digest that is not sha256")
        if "publicKey" in material:
            hint = str(material["publicKey"].get("hint") or "")
            claim = Claim(f"key sha256:{hint[:16]}" if hint else "a key it does not name", "key", digests)
        elif "x509CertificateChain" in material:
            leaf = material["x509CertificateChain"]["certificates"][0]["rawBytes"]
            claim = Claim(_certificate_name(base64.b64decode(leaf)), "certificate", digests)
        elif "certificate" in material:
            claim = Claim("a keyless Sigstore identity, " + _certificate_name(
                base64.b64decode(material["certificate"]["rawBytes"])), "sigstore", digests)
        else:
            raise ValueError("no key, certificate or Sigstore identity in it")
    except (KeyError, IndexError, TypeError, AttributeError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(" ".join(str(e).split())[:160] or type(e).__name__) from None
    for name in digests:
        why = name_problem(name)
        if why:
            raise ValueError(f"it lists {why}: not a name inside the artifact")
    return claim


def sign_files(files: dict[str, Path | bytes], signature: Path, key: SigningKey) -> float:
    """Sign ``files`` (name in the repository -> the local file, or the bytes of a generated one) into
    ``signature``; returns the seconds it took. The library hashes a folder, so the set is laid out as a
    view in a temporary folder beside the signature, removed after: a symbolic link per local file
    (files the caller has checked as regular files of the artifact) and the generated bytes; the
    signed manifest names each by its place in the repository, which must be a name inside it."""
    import time

    from model_signing import hashing, signing

    for name in files:
        why = name_problem(name)
        if why:
            raise ArtifactError(f"{why}: not a name inside the artifact; nothing was signed")
    if key.kind not in ("key", "certificate"):
        raise UserError(f"unknown signing method {key.kind!r} (key, certificate)")
    t0 = time.perf_counter()
    signature.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sign-view-", dir=signature.parent) as view:
        root = Path(view)
        # a link, not a hard link: a hard link would move the file's ctime (the hash cache's key)
        _view({n: src for n, src in files.items() if not isinstance(src, bytes)}, root)
        for name, src in files.items():
            if isinstance(src, bytes):
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(src)
        cfg = signing.Config().set_hashing_config(
            hashing.Config().use_file_serialization(hashing_algorithm="sha256").set_allow_symlinks(True))
        try:
            if key.kind == "key":
                cfg.use_elliptic_key_signer(private_key=key.private_key)
            else:
                cfg.use_certificate_signer(private_key=key.private_key, signing_certificate=key.certificate,
                                           certificate_chain=list(key.chain))
        except (ValueError, TypeError) as e:  # not a PEM key, a certificate of another key, an unsupported curve
            raise UserError(f"cannot sign with {key.private_key}: {' '.join(str(e).split())[:200]}") from None
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


def read_bundle_bytes(signature: Path) -> bytes:
    """The signature file's bytes, checked before anything parses them (``core.bounded_read``): a
    regular file (a FIFO in its place is refused, never waited on), at most ``SIGNATURE_CAP`` bytes,
    JSON nested at most ``MAX_DEPTH`` deep (a refusal is one line, exit 2), an object (else a
    ``ValueError``: an invalid signature). The library is
    then handed a copy of these bytes, never the file again."""
    raw = read_bytes(signature, SIGNATURE, SIGNATURE_CAP)
    if not isinstance(parse_json(raw, SIGNATURE, error=ValueError), dict):
        raise ValueError("not a Sigstore bundle (a JSON object)")
    return raw


class _Anchor:
    """A trusted key (PEM public key) or certificate (PEM, a CA the signer's chain leads to)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pem = read_bytes(self.path, f"--trust-key {path}", SECRET_CAP)  # a PEM key or CA chain: a few KB
        self.kind = "certificate" if b"-----BEGIN CERTIFICATE-----" in self.pem else "key"

    def config(self):
        from model_signing import verifying

        cfg = verifying.Config()
        if self.kind == "certificate":
            return cfg.use_certificate_verifier(certificate_chain=[self.path])
        return cfg.use_elliptic_key_verifier(public_key=self.path)


def _hashing():
    """The library's hashing of the view, noting that it was asked: the library hashes the files
    only once the bundle's signature has verified, so a failure after that is the files'."""
    from model_signing import hashing

    class Hashing(hashing.Config):
        reached = False

        def hash(self, model_path, *, files_to_hash=None):
            self.reached = True
            return super().hash(model_path, files_to_hash=files_to_hash)

    return Hashing().use_file_serialization(hashing_algorithm="sha256").set_allow_symlinks(True)


def _view(files: dict[str, Path], folder: Path) -> None:
    """The files as signed, laid out in ``folder``: a link per name to the artifact's file."""
    for name, src in files.items():
        dst = folder / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(Path(src).resolve(), dst)


def check_signature(signature: Path, files: dict[str, tuple[Path, str]], trusted: list[Path]) -> SignatureCheck:
    """The signature at ``signature`` against ``files`` (name as published -> the artifact's file and
    the sha256 it was found to have), verified with the ``trusted`` public keys or CA certificates
    (the module's docstring)."""
    import time

    t0 = time.perf_counter()
    if not os.path.lexists(signature):
        return SignatureCheck("unsigned")
    try:  # a FIFO, an endless file or deep nesting: one line, never a hang or a traceback
        raw = read_bundle_bytes(signature)
        claim = read_claim(raw)
    except ValueError as e:
        return SignatureCheck("invalid", problem=f"{SIGNATURE} is not a signature this tool can read ({e})")
    if not trusted:
        return SignatureCheck("unchecked", claim.signer, files=len(claim.digests))
    expected = {n: sha for n, (_, sha) in files.items()}
    bad = sorted(n for n in set(claim.digests) | set(expected) if claim.digests.get(n) != expected.get(n))
    anchors = [_Anchor(p) for p in trusted]
    from . import local_trust

    key = local_trust.verdict_key(raw, expected, [a.pem for a in anchors])
    if not bad and (known := local_trust.recalled_verdict(key)):
        return SignatureCheck("verified", known["signer"], None, len(expected), time.perf_counter() - t0,
                              cached=True)
    last = "no trusted key was given"
    with tempfile.TemporaryDirectory(prefix="hybrid-build-verify-") as tmp:
        view, checked = Path(tmp) / "view", Path(tmp) / SIGNATURE
        view.mkdir()
        _view({n: p for n, (p, _) in files.items()}, view)
        checked.write_bytes(raw)  # the library reads the bytes checked above, never the artifact's file again
        for anchor in anchors:
            hashing_cfg = _hashing()
            try:
                anchor.config().set_hashing_config(hashing_cfg).verify(view, checked)
            except Exception as e:  # noqa: BLE001 - the library raises ValueError or its own errors
                if not hashing_cfg.reached:
                    last = " ".join(str(e).split())[:160] or type(e).__name__
                    continue
                signer = _signer(anchor, claim)
                if not bad:  # the files changed under the check, or could not be read
                    why = " ".join(str(e).split())[:160]
                    return SignatureCheck("invalid", signer, f"the files do not match it ({why})", len(claim.digests),
                                          time.perf_counter() - t0)
                n = bad[0]
                why = ("is not in the signed manifest" if n not in claim.digests else "is signed but missing"
                       if n not in expected else "has other bytes than the signature records")
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                return SignatureCheck("invalid", signer, f"{n} {why}{more}", len(claim.digests),
                                      time.perf_counter() - t0, bad)
            signer = _signer(anchor, claim)
            local_trust.remember_verdict(key, signer, len(expected))
            return SignatureCheck("verified", signer, None, len(expected), time.perf_counter() - t0)
    if claim.kind == "sigstore":
        last = ("a keyless Sigstore signature: hybrid-build checks key and certificate signatures; check it with "
                "`model_signing verify sigstore`")
    return SignatureCheck("invalid", problem=f"{SIGNATURE} does not verify with the trusted key(s): {last}",
                          seconds=time.perf_counter() - t0)


def _signer(anchor: _Anchor, claim: Claim) -> str:
    """Who signed, once verified: the trusted key, or the certificate the library checked against the
    trusted CA (the bundle's leaf)."""
    return key_fingerprint(anchor.pem) if anchor.kind == "key" else claim.signer
