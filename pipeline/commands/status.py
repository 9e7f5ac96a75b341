"""``hybrid-build status``: each stage's state, the reports and the source of an output folder."""
from __future__ import annotations

import argparse
from pathlib import Path

from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag, emit_json, progress

EPILOG = """examples:
  hybrid-build status out/
  hybrid-build status out/ --json

A stage is done when its manifest's key is the one it would have now (tool version, the source's
content, its recipe section, the results it read) and its outputs are intact; stale says why not;
missing: it has not finished here; unknown: the source is not reachable, so the key cannot be
recomputed. A report is current when it records this build's provenance sha256. The artifact's
files are checked against the provenance (sha256, cached by size, mtime, ctime, inode and device
in .hybrid-build/artifact-sha256.json): a file that differs is named and makes the stage that
wrote it stale. validation: the build's latest validate outcome (passed, failed, could not run,
missing, stale) with the reason and the time; `--json` has it under "validation". trust: whether
this machine built or validated this build (its records, in the user's state folder), and the trust
records the folder carries itself, which are named and ignored; `--json`: "trust". Reads the output
folder alone (and the source where the build recorded it). Exit 0 whatever the stages' and
reports' states, 1 when the artifact's files are not what its provenance binds (a changed, missing,
unlisted or linked file, a reference or signature that is not sound: the line names the file, as
serve and publish refuse it), 2 when the folder is not an output of `hybrid-build run`.
"""


def _render(data: dict) -> str:
    lines = [f"output   {data['output']}  ("
             + (f"built, provenance {data['provenance_sha256'][:12]}" if data["built"]
                else f"NOT FINISHED: {data['in_progress']}" if data.get("in_progress") else "not built yet")
             + (f", recipe {data['recipe']}" if data["recipe"] else "") + ")"]
    src = data["source"]
    lines.append(f"source   {src['where'] or '-'}: {src['state']}" + (f" ({src['reason']})" if src["reason"] else ""))
    art = data.get("artifact")
    if art is not None:
        lines.append(f"files    {art['files']} match the provenance ({art['cached']} from the hash cache, "
                     f"{art['hashed']} hashed)" if art["intact"]
                     else f"files    DIFFER from the provenance: {art['problem']}")
    sig = data.get("signature")
    if sig is not None:
        from hybrid_build.core.signing import SignatureCheck

        lines.append("signature " + SignatureCheck(sig["state"], sig["signer"], sig["problem"], sig["files"]).line())
    trust = data.get("trust")
    if trust is not None:
        lines.append("trust    " + ("built on this machine" if trust["built_here"] else "validated on this machine"
                                  if trust["validated_here"] else "neither built nor validated on this machine"))
        if trust["line"]:
            lines.append(f"trust    {trust['line']}")
    v = data["validation"]
    when = f" at {v['finished_at']}" if v.get("finished_at") else ""
    lines.append(f"validation {v['state'].upper() if v['state'] == 'failed' else v['state']}{when}: {v['reason']}"
                 + (f"  [{v['report']}]" if v.get("report") else ""))
    lines.append("stages")
    for s in data["stages"]:
        lines.append(f"  {s['stage']:<14} {s['state']:<8} {s['reason']}")
    lines.append("reports")
    for r in data["reports"]:
        files = ", ".join(r["files"]) if r["files"] else ""
        lines.append(f"  {r['report']:<14} {r['state']:<8} {r['reason']}" + (f"  [{files}]" if files else ""))
    for r in data.get("serving", []):
        state = r["state"] if r["alive"] or r["state"] == "stopped" else f"{r['state']}, but serve is gone"
        if r.get("orphan_engine"):
            state = (f"{r['state']}, but serve is gone and its engine (pid {r['orphan_engine']}) still runs, holding "
                     f"the port and the memory (stop it: kill -TERM -{r['orphan_engine']})")
        line = (f"serve    {r['profile']}: {state}; {r['restarts']} restart(s) of {r['restart_limit']}"
                f" (log {r['log']})")
        fault = r.get("last_fault")
        if fault:
            from hybrid_build.serve.launch.watch import stamp

            line += f"; last fault {stamp(fault['at'])} {fault['kind']}: {fault['detail']}"
        lines.append(line)
    for rel in data["unexpected"]:
        lines.append(f"unexpected file: {rel} "
                     "(neither a build output nor a known report: validate and publish refuse it)")
    return "\n".join(lines)


def _handle(args: argparse.Namespace) -> int:
    from ..status import output_status

    status = output_status(args.out, progress=lambda **kw: progress(args.quiet or args.json, leave=False, **kw))
    data = status.to_json()
    if args.json:
        emit_json(data)
    else:
        print(_render(data))
    art = data.get("artifact")
    if art is not None and not art["intact"]:  # what serve and publish refuse: a failed check, named
        import sys

        print(f"error: {art['problem']}", file=sys.stderr, flush=True)
        return 1
    return 0


def register(sub, common) -> None:
    p = sub.add_parser(
        "status", parents=[common], formatter_class=ExampleFormatter, epilog=EPILOG,
        help="what an output folder holds: each stage done, stale or missing, the reports, the source",
        description="Read an output folder of `hybrid-build run` (no source or recipe argument) and say, for each "
                    "stage, whether its result is done, stale (and why) or missing; which reports "
                    "(validation, eval, bench) exist and whether each was made for this build; and where the "
                    "recorded source is, whether it is reachable and unchanged by content.")
    p.add_argument("out", type=Path, metavar="OUT", help="the output folder of `hybrid-build run`")
    add_json_flag(p)
    p.set_defaults(handler=_handle)
