"""``hybrid-build publish``: the command line over ``hybrid_build.pipeline.publish``."""
from __future__ import annotations

import argparse
import sys

from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag, emit_json
from hybrid_build.core.errors import UserError

EPILOG = """examples:
  hybrid-build publish out/ --repo-id my-org/Qwen3.5-122B-A10B-hybrid --dry-run
  hybrid-build publish out/ --repo-id my-org/Qwen3.5-122B-A10B-hybrid --private
  hybrid-build publish out/ --repo-id my-org/Qwen3.5-122B-A10B-hybrid --create-pr

The token comes from HF_TOKEN or `hf auth login`. An interrupted upload resumes when the same
command is run again: files already on the Hub with the right sha256 are not sent again.
"""


def register(sub, common) -> None:
    p = sub.add_parser("publish", parents=[common], formatter_class=ExampleFormatter, epilog=EPILOG,
                       help="upload a validated artifact to the Hugging Face Hub",
                       description="Upload a validated hybrid artifact to the Hub with a generated model card, "
                                   "then check the remote files against the provenance manifest. Before the first "
                                   "byte is sent, every file is checked against the provenance (size and sha256, "
                                   "cached by stat in .hybrid-build/artifact-sha256.json); --force does not skip it.")
    p.add_argument("artifact", metavar="ARTIFACT", help="the folder `hybrid-build run` wrote")
    p.add_argument("--repo-id", required=True, metavar="ORG/NAME", help="the Hub model repo (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repo private (no effect if it exists)")
    p.add_argument("--revision", metavar="BRANCH", default=None,
                   help="branch to push to (created if needed; default main)")
    p.add_argument("--create-pr", action="store_true",
                   help="open a pull request instead of pushing to the branch (a re-run continues the same PR)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the files, their sizes, what was checked against the provenance (files, bytes, "
                        "from the hash cache or hashed) and the model card; send nothing")
    p.add_argument("--force", action="store_true",
                   help="publish even if validation is missing or failed (the card says so)")
    s = p.add_argument_group("signing (OpenSSF Model Signing: model.sig, uploaded beside the files it covers)")
    s.add_argument("--sign-key", metavar="KEY.pem", help="sign with this EC private key (PEM); users verify with "
                   "its public key (`serve --trust-key`, `verify-artifact --trust-key`)")
    s.add_argument("--sign-cert", metavar="CERT.pem", help="with --sign-key: the key's certificate (the signer "
                   "is named by it; users verify with a CA certificate its chain leads to: `--trust-key CA.pem`)")
    s.add_argument("--sign-chain", metavar="CA.pem", action="append", default=[],
                   help="with --sign-cert (needed): a certificate of its chain, the issuing CA's at least; repeatable")
    # keyless Sigstore signing is refused (its check needs an identity, an issuer and Sigstore's online
    # trust root, which this tool does not take): kept as a flag only to say so in one line
    s.add_argument("--sigstore", action="store_true", help=argparse.SUPPRESS)
    add_json_flag(p)
    p.set_defaults(handler=run, resumes=True)  # what reached the Hub is not sent again


def _signing_key(args: argparse.Namespace):
    from pathlib import Path

    from hybrid_build.core.signing import SigningKey

    if args.sigstore:
        raise UserError("--sigstore: keyless Sigstore signing is not offered, because serve, status and "
                        "verify-artifact could not check such a signature; sign with --sign-key (and --sign-cert "
                        "for a certificate)")
    if args.sign_cert and not args.sign_key:
        raise UserError("--sign-cert needs --sign-key (the certificate's private key)")
    if args.sign_chain and not args.sign_cert:
        raise UserError("--sign-chain needs --sign-cert")
    if args.sign_cert and not args.sign_chain:  # model-signing's certificate signer needs one
        raise UserError("--sign-cert needs --sign-chain: the certificate of the CA that issued it (and any between)")
    for flag, path in (("--sign-key", args.sign_key), ("--sign-cert", args.sign_cert),
                       *(("--sign-chain", c) for c in args.sign_chain)):
        if path and not Path(path).is_file():
            raise UserError(f"{flag} {path}: no such file")
    if not args.sign_key:
        return None
    if args.sign_cert:
        return SigningKey("certificate", Path(args.sign_key), Path(args.sign_cert),
                          tuple(Path(c) for c in args.sign_chain))
    return SigningKey("key", Path(args.sign_key))


def make_api():
    """The Hub client; tests replace this with a recording stand-in."""
    from huggingface_hub import HfApi

    return HfApi()


def make_retry():
    """The retry policy for Hub calls; tests replace it with one that does not sleep."""
    from ..publish import RetryPolicy

    return RetryPolicy()


def _send_line(todo, already: int) -> None:
    from hybrid_build.core.byte_units import human_bytes

    sent = sum(f.bytes for f in todo)
    if not todo:
        sys.stderr.write(f"all {already} file(s) already on the Hub\n")
        return
    sys.stderr.write(f"sending {len(todo)} file(s), {human_bytes(sent)}"
                     + (f"; {already} already on the Hub" if already else "") + "\n")
    sys.stderr.flush()


def _print_plan(plan, revision: str) -> None:
    from hybrid_build.core.byte_units import human_bytes

    out = sys.stdout
    out.write(f"dry run: would publish {len(plan.files)} files, {plan.total_bytes:,} bytes "
              f"({human_bytes(plan.total_bytes)}) to {plan.repo_id} ({revision}); nothing is sent\n")
    width = max(len(f"{f.bytes:,}") for f in plan.files)
    for f in plan.files:
        what = {"card": "  (generated model card)",
                "signature": "  (signature, OpenSSF Model Signing)"}.get(f.origin, "")
        out.write(f"  {f.bytes:>{width},}  {f.path}{what}\n")
    out.write(f"total {plan.total_bytes:,} bytes in {len(plan.files)} files\n")
    c = plan.checked
    if c:
        out.write(f"checked: {c['files']} files, {human_bytes(c['bytes'])} against hybrid_build/provenance.json "
                  f"(size and sha256): {c['cached']} from the hash cache, {c['hashed']} hashed "
                  f"({human_bytes(c['hashed_bytes'])}) in {c['seconds']:.2f} s\n")
    out.write(f"validation: {plan.validation.state}" + (" (--force)" if plan.forced else "") + "\n")
    if plan.signed_seconds is not None:
        out.write(f"signed: model.sig over {len(plan.files) - 1} files in {plan.signed_seconds:.2f} s\n")
    for note in plan.notes:
        out.write(f"note: {note}\n")
    out.write("\n----- README.md -----\n")
    out.write(plan.card_text if plan.card_text.endswith("\n") else plan.card_text + "\n")


def run(args: argparse.Namespace) -> int:
    from ..publish import Publisher, plan_publish

    if args.revision and args.revision.startswith("refs/"):
        raise UserError("--revision takes a branch name; use --create-pr for a pull request")
    from hybrid_build.core.cli_support import progress

    key = _signing_key(args)
    plan = plan_publish(args.artifact, args.repo_id, force=args.force,
                        progress=lambda **kw: progress(args.quiet or args.json, leave=False, **kw))
    if key is not None:
        from ..publish import sign_plan

        sign_plan(plan, key)  # written into the artifact (the dry run too: nothing is sent)
    revision = args.revision or "main"
    if args.dry_run:
        if args.json:
            emit_json({**plan.to_json(), "dry_run": True, "revision": revision, "card": plan.card_text})
        else:
            _print_plan(plan, revision)
        return 0
    api = make_api()
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE and type(api).__module__.startswith("huggingface_hub"):
        raise UserError("HF_HUB_OFFLINE is set: publishing needs the network (unset it, or use --dry-run)")
    quiet = args.quiet or args.json
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    # huggingface_hub draws the live progress of the upload (bytes, speed, commits) while it runs;
    # a second bar of ours on the same terminal would garble it, so before it we print a line.
    publisher = Publisher(plan, api, private=args.private, revision=args.revision, create_pr=args.create_pr,
                          retry=make_retry(), on_send=None if quiet else _send_line)
    result = publisher.run()
    from ..publish import keep_card

    keep_card(plan)  # the folder's card is what the repository's README.md now holds
    if args.json:
        emit_json(result.to_json())
        return 0
    sys.stdout.write(f"published {plan.repo_id} ({result.revision}): {len(result.uploaded)} files sent "
                     f"({result.uploaded_bytes:,} bytes), {len(result.skipped)} already there; "
                     f"{result.verified} files verified against the provenance manifest\n")
    if result.pr_url:
        sys.stdout.write(f"pull request: {result.pr_url}\n")
    if result.remote_extra:
        sys.stdout.write(f"note: the repo also holds {len(result.remote_extra)} file(s) this artifact does not "
                         f"have, e.g. {result.remote_extra[0]}\n")
    for note in plan.notes:
        sys.stdout.write(f"note: {note}\n")
    if plan.forced:
        sys.stdout.write(f"warning: published with --force (validation {plan.validation.state})\n")
    return 0
