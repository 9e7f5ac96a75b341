"""``hybrid-build verify-artifact``: the artifact folder checked as ``serve`` and ``publish`` check
it (``core.bound``), with its signature: who signed it and that every file matches."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag, emit_json, progress

EPILOG = """examples:
  hybrid-build verify-artifact out/ --trust-key publisher.pub
  hybrid-build verify-artifact ~/models/Qwen3.5-122B-A10B-hybrid --trust-key publisher.pub --require-signature

Exit 0 when every file and report matches the provenance (and a signature, where one is checked,
verifies with a trusted key and covers every file); 1 when a file, a report, the reference or the
signature is not sound, or, with --require-signature, when no trusted signature vouches for it; 2
when the folder is not an artifact. "artifact sound" is said only of a folder whose signature was
verified: without --trust-key the signer the signature names is shown, and said to be unchecked.
--trust-key takes a public key (`--sign-key` signatures) or a CA certificate (`--sign-cert`
signatures chaining to it). A verified signature is remembered in the user's state folder, so the
files are hashed for it once. The signature is also checkable without hybrid-build, with OpenSSF
Model Signing's own CLI: `model_signing verify key --signature model.sig --public_key publisher.pub
--ignore_unsigned_files FOLDER` (`verify certificate --certificate_chain CA.pem` for a certificate).
"""


def _verdict(bound, problems: list[str]) -> str:
    """The last line: "sound" only where a trusted signature vouches for the files; otherwise what was
    checked (the files against the folder's own provenance) and that nobody vouches for them."""
    if problems:
        return f"artifact NOT sound: {problems[0]}"
    sig = bound.signature
    if sig.verified:
        return f"artifact sound: every file matches its provenance and the signature of {sig.signer}"
    who = (f"its signature names {sig.signer} but was NOT checked (no --trust-key given)"
           if sig.state == "unchecked" else "it is unsigned")
    return f"artifact consistent with its own provenance; {who}: nobody vouches for these files"


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.core.bound import open_artifact, trusted_keys

    bound = open_artifact(args.artifact, trusted=trusted_keys(args.trust_key),
                          progress=lambda **kw: progress(args.quiet or args.json, leave=False, **kw))
    problems = list(bound.problems)
    if args.require_signature and not bound.signature.verified and bound.signature.state != "invalid":
        problems.append(bound.signature.line())
    if args.json:
        emit_json({**bound.to_json(), "outcome": "passed" if not problems else "failed", "problems": problems})
    else:
        out = sys.stdout
        out.write(f"files      {bound.integrity.summary()}\n")
        sig = bound.signature
        timed = f" ({sig.seconds:.2f} s)" if sig.state in ("verified", "invalid") else ""
        out.write(f"signature  {sig.line()}{timed}\n")
        v = bound.validation
        out.write(f"validation {v.state}: {v.reason}\n")
        for line in problems:
            out.write(f"PROBLEM    {line}\n")
        out.write(_verdict(bound, problems) + "\n")
    return 0 if not problems else 1


def register(sub, common) -> None:
    p = sub.add_parser(
        "verify-artifact", parents=[common], formatter_class=ExampleFormatter, epilog=EPILOG,
        help="check an artifact folder: every file and report against the provenance, the reference, the signature",
        description="Open the artifact as serve and publish do: a finished build (no in-progress marker), regular "
                    "files only (a symbolic link is refused), every build output and report with the size and "
                    "sha256 the provenance records and nothing else, a reference that is the one the validation "
                    "report rests on with finite values, and, where model.sig is there (OpenSSF Model Signing), "
                    "who signed it and that every file it covers matches.")
    p.add_argument("artifact", type=Path, metavar="ARTIFACT", help="the artifact folder")
    p.add_argument("--trust-key", action="append", metavar="PUB.pem", default=None,
                   help="a public key, or a CA certificate, whose signatures you trust; repeatable (default: "
                        "$HYBRID_BUILD_TRUSTED_KEYS)")
    p.add_argument("--require-signature", action="store_true",
                   help="fail unless the artifact carries a signature by a trusted key")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
